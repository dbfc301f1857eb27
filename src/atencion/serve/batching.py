"""Dynamic batching: requests that arrive together are decoded together.

Each model has one worker thread (torch runs there, never in the event loop). A request becomes
a job on the model's queue; the worker takes the oldest job, waits up to ``max_wait_ms`` for
others with the same decoding settings, takes as many as fit in ``batch_tokens`` source tokens,
decodes all their sentences in one call of ``translate_lines`` (which sorts them by length), and
hands each job its part. So under concurrency the batch grows instead of requests queueing one
behind another, and a lone request waits at most ``max_wait_ms`` more than it would alone.

The language models' endpoints (generate, fill-mask, classify) are not batched across requests:
a ``Worker`` runs each model's requests one at a time on a thread of its own, with the same
bounded queue. A /generate request's samples are drawn as one batch, or, with a draft model
(`serve --draft`), one after another: speculative decoding continues one text at a time, since
each accepts its own number of draft tokens per round (``tasks.lm.generate_text``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..decode.continuous import QueueFull
from ..decode.settings import DecodeConfig
from ..decode.translate import Translation, translate_lines
from ..errors import AtencionError

log = logging.getLogger(__name__)


@dataclass
class Job:
    sentences: list[str]
    tokens: int                               # source pieces in all its sentences
    decode: DecodeConfig                      # batch_tokens aside: the Batcher's budget replaces it
    done: Callable[[Any, BaseException | None], None]   # called once, from the worker thread
    nbest: int = 1
    attention: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    cancelled: bool = False                   # the client gave up (timeout): skip it

    @property
    def options(self) -> tuple[DecodeConfig, int]:
        """The settings a batch must share."""
        return self.decode, self.nbest


class Batcher:
    """The queue and worker thread of one model."""

    def __init__(self, model, tokenizer, batch_tokens: int, max_wait_ms: float, max_queue: int,
                 on_batch: Callable[[int, int], None] | None = None, name: str = "model",
                 start: Callable[[], None] | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.batch_tokens, self.max_wait, self.max_queue = batch_tokens, max_wait_ms / 1000, max_queue
        self.on_batch = on_batch or (lambda sentences, tokens: None)
        self._jobs: deque[Job] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, args=(start,), name=f"batcher-{name}", daemon=True)
        self._thread.start()

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(self, job: Job) -> None:
        with self._cv:
            if len(self._jobs) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry shortly")
            self._jobs.append(job)
            self._cv.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the jobs already queued, then end the worker."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # the worker --------------------------------------------------------------------------------

    def _work(self, start: Callable[[], None] | None) -> None:
        if start is not None:
            _started(start)
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._run(batch)
            except BaseException as err:  # noqa: BLE001 - every job must hear back, whatever happened
                log.exception("batch of %d requests failed", len(batch))
                for job in batch:
                    job.done(None, err)

    def _next_batch(self) -> list[Job] | None:
        with self._cv:
            while not self._jobs:
                if self._stopping:
                    return None
                self._cv.wait()
            first = self._jobs[0]
            deadline = first.enqueued + self.max_wait
            # Wait for company until the deadline or until the budget is full.
            while not self._stopping and time.monotonic() < deadline and self._fits() < self.batch_tokens:
                self._cv.wait(max(deadline - time.monotonic(), 0))
            batch, tokens, kept = [], 0, deque()
            while self._jobs:
                job = self._jobs.popleft()
                if job.cancelled:
                    continue
                same = job.options == first.options or not batch
                if same and (not batch or tokens + job.tokens <= self.batch_tokens):
                    if not batch:
                        first = job
                    batch.append(job)
                    tokens += job.tokens
                else:
                    kept.append(job)
            self._jobs.extendleft(reversed(kept))
            return batch

    def _fits(self) -> int:
        """Source tokens of the queued jobs that share the first job's settings."""
        options = self._jobs[0].options
        return sum(job.tokens for job in self._jobs if job.options == options and not job.cancelled)

    def _run(self, batch: list[Job]) -> None:
        if not batch:
            return
        first = batch[0]
        decode = dataclasses.replace(first.decode, batch_tokens=self.batch_tokens)
        lines = [s for job in batch for s in job.sentences]
        results = translate_lines(self.model, self.tokenizer, lines, decode, nbest=first.nbest, source="request")
        self.on_batch(len(lines), sum(job.tokens for job in batch))
        start = 0
        for job in batch:
            mine = results[start: start + len(job.sentences)]
            start += len(job.sentences)
            try:
                extra = [self._attention(s, hyps[0]) for s, hyps in zip(job.sentences, mine)] \
                    if job.attention else None
            except AtencionError as err:
                job.done(None, err)
                continue
            job.done((mine, extra), None)

    def _attention(self, sentence: str, best: Translation) -> dict[str, Any]:
        from ..viz.attention import capture_attention, word_alignment

        attention = capture_attention(self.model, self.tokenizer, sentence, best.tokens)
        return {**attention_json(attention), "alignment": sorted([i, j] for i, j in word_alignment(attention.cross))}


def attention_json(attention) -> dict[str, Any]:
    """A capture's maps as the page reads them: BertViz's layout, and each kind's rows, columns
    and weights (layers × heads × rows × columns) in pieces and in words."""
    from ..viz.report import bertviz_data

    def maps(a):
        return {kind: {"rows": m.rows, "cols": m.cols, "weights": m.weights.round(5).tolist()}
                for kind, m in a.maps().items()}

    return {"bertviz": bertviz_data(attention), "pieces": maps(attention), "words": maps(attention.to_words())}


class Worker:
    """The thread of one model that runs its requests one after another, and their bounded queue."""

    def __init__(self, max_queue: int, name: str = "model", start: Callable[[], None] | None = None):
        self.max_queue, self.waiting = max_queue, 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"worker-{name}",
                                            initializer=None if start is None else lambda: _started(start))
        self._executor.submit(lambda: None).result()  # its thread started (``start`` done) before any request

    def __len__(self) -> int:
        return self.waiting

    async def run(self, work: Callable[[], Any], timeout_s: float) -> Any:
        """``work()`` on the model's thread; QueueFull when ``max_queue`` requests already wait,
        asyncio.TimeoutError after ``timeout_s`` (a request that has not started is dropped)."""
        if self.waiting >= self.max_queue:
            raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry shortly")
        self.waiting += 1  # only the event loop's thread counts: no lock
        try:
            future = asyncio.get_running_loop().run_in_executor(self._executor, work)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self.waiting -= 1

    def stop(self) -> None:
        """Finish the requests already queued, then end the thread."""
        self._executor.shutdown(wait=True)


def _started(start: Callable[[], None]) -> None:
    """A model thread's first work (its torch threads, its kernels warmed): a failure is logged, and the
    thread serves on (the kernels are then measured at the first request)."""
    try:
        start()
    except Exception:  # noqa: BLE001 - a warm-up that fails must not take the model's thread with it
        log.exception("a model thread's start failed")


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future):
    """A ``done`` callback for a Job that settles ``future`` on its event loop."""
    def done(result, error) -> None:
        def settle() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
        loop.call_soon_threadsafe(settle)
    return done
