"""Continuous batching (Orca: Yu et al., OSDI 2022; vLLM): one decoding loop per model, where a
request joins the running batch at the next step and a finished one leaves at once, instead of
requests batched whole (a short one waiting for a long one).

Each request is a ``Sequence``: its prompt ids, how to choose its tokens (``SamplingConfig``'s
temperature, top-k, top-p, and a generator of its own, so that a seeded request draws the same
tokens whoever shares its steps), its stop tokens and its limits. The ``Engine``'s thread runs the
loop: between two steps it admits the sequences that wait (at most ``max_sequences`` running and
``max_tokens`` prompt-plus-new tokens in flight, first come first served), reads each joining
prompt whole (its prefill, the model's own ``decode_step``; the first new token comes from it),
then decodes one token of every running sequence in one step, and tells each sequence's owner
(``Sequence.on_event``, called on the engine's thread) its token, the token's log-probability and
the most likely alternatives when asked, and why it ended.

The step is Orca's *selective batching*: the products (projections, feed-forward, the projection to
the vocabulary) run on all rows at once, which is what batching buys on a memory-bound CPU (each
weight read once per step, not once per request); attention runs per row over that row's own keys,
at that row's own position. The keys and values live in ``Slots``: per layer one buffer
(rows, kv heads, capacity, d_k) where running sequence i owns row i (kept compact: a sequence that
leaves gives its row to the last one), so a step's attention is one call over the rows' keys up
to the longest, each row masked past its own length. A sequence that runs alone takes the
model's own single-row step (nn/fused.py where it applies), as `atencion generate` does.

Models whose step this cannot split (another attention kind, a relative-position bias, a mixture
of experts, an encoder-decoder) still share the loop, their sequences stepped one after another
with the model's own ``decode_step``: requests join and leave at every step, without the shared
products. ``Engine.run`` also runs any other work on the model's thread between two steps (the
server's /generate and /attention), so one thread ever runs a model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import AtencionError
from ..nn.attention import scaled_dot_product_attention
from ..nn.cache import DecoderState
from ..nn.matvec import PANEL_ROWS
from ..nn.moe import MoEFeedForward
from ..nn.positional import position_limit, rotate_half, rotates
from ..nn.prefix import places
from .sample import check_sampling, choose_next, is_greedy

log = logging.getLogger(__name__)
TOP_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (OpenAI's limit)


class QueueFull(AtencionError):
    """More requests wait than the engine accepts (the server answers 429)."""


@dataclass
class Event:
    """What a sequence's owner hears: the prompt's log-probabilities (``prompt``, once, first, when
    asked), a new ``token`` (its ``logprob`` and ``top`` alternatives when asked), or the end:
    ``finish`` ("stop": a stop token, "length": max_new_tokens, "cancelled") or an ``error``."""

    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    prompt: list[tuple[float | None, list[tuple[int, float]]]] | None = None
    finish: str | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class Sequence:
    """One request's text to continue: ``ids`` (its prompt), up to ``max_new_tokens`` new tokens
    chosen as ``temperature``, ``top_k``, ``top_p`` and ``generator`` say (decode/sample.py's
    ``choose_next``), ending at any of ``stop_ids``; ``logprobs``: report each new token's
    log-probability and its ``logprobs`` most likely alternatives (0: none; None: no
    log-probabilities); ``prompt_logprobs`` the same for the prompt's tokens. ``on_event`` hears
    each ``Event`` on the engine's thread. Set ``cancelled`` (``Engine.cancel``) to end it at the
    next step (a client that left)."""

    ids: list[int]
    max_new_tokens: int
    on_event: Callable[[Event], None]
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    stop_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    cancelled: bool = False
    ended: bool = False                 # its end was told
    logits: list[Tensor] | None = None  # a list: each chosen token's logits (vocab,) appended (tests compare them)
    # the engine's
    new: int = 0                       # tokens chosen so far
    last: int | None = None            # the token the next step reads
    state: DecoderState | None = None  # its own caches, while it runs alone (or the model's step cannot be split)
    length: int = 0                    # keys held (in ``state`` or in its row of the Slots)
    position: int = 0                  # the position of the token the next step reads

    @property
    def tokens(self) -> int:
        """What it may hold at most: prompt and new tokens (``Engine``'s ``max_tokens`` counts them)."""
        return len(self.ids) + self.max_new_tokens


def splits(model) -> bool:
    """Whether the step of ``model`` can run its rows at different positions in one batch
    (``batch_step``): a decoder-only model with eq. (1) attention, absolute positions, RoPE or none
    (not a score bias) and no mixture of experts (whose capacity makes a row depend on the others)."""
    cfg, decoder = model.cfg, getattr(model, "decoder", None)
    if cfg.arch != "decoder" or decoder is None or not decoder.full:
        return False
    if decoder.relative is not None and not rotates(decoder.relative):
        return False
    return not any(isinstance(layer.ffn, MoEFeedForward) for layer in decoder.layers)


class Slots:
    """The keys and values of the running sequences, per layer one buffer (rows, kv heads,
    capacity, d_k): sequence i of the batch owns row i. Grown (doubled) as rows and lengths need."""

    def __init__(self, model):
        attention = model.decoder.layers[0].self_attn
        self.layers, self.heads, self.d_k = len(model.decoder.layers), attention.g, attention.d_k
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    @property
    def rows(self) -> int:
        return self.keys[0].size(0) if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].size(2) if self.keys else 0

    def ensure(self, rows: int, length: int, like: Tensor) -> None:
        """Room for ``rows`` rows of ``length`` keys (buffers like ``like``'s dtype and device)."""
        if rows <= self.rows and length <= self.capacity:
            return
        new_rows, new_length = max(rows, 2 * self.rows, 4), max(length, 2 * self.capacity, 64)
        for buffers in (self.keys, self.values):
            for i in range(self.layers):
                grown = like.new_zeros(new_rows, self.heads, new_length, self.d_k)
                if i < len(buffers):
                    old = buffers[i]
                    grown[: old.size(0), :, : old.size(2)] = old
                    buffers[i] = grown
                else:
                    buffers.append(grown)

    def put(self, row: int, state: DecoderState) -> None:
        """A sequence's own caches into ``row``."""
        first = state.self_caches[0].k
        self.ensure(row + 1, first.size(2) + 1, first)
        for i, cache in enumerate(state.self_caches):
            length = cache.k.size(2)
            self.keys[i][row, :, :length] = cache.k[0]
            self.values[i][row, :, :length] = cache.v[0]

    def move(self, source: int, target: int, length: int) -> None:
        """Row ``source``'s first ``length`` keys and values into row ``target``."""
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[target, :, :length] = buffer[source, :, :length]

    def state(self, model, row: int, length: int, position: int) -> DecoderState:
        """A decoding state whose caches hold ``row``'s first ``length`` keys (copied at its next
        step, into buffers of its own), at ``position``: for a sequence left alone."""
        state = model.init_state()
        for i, cache in enumerate(state.self_caches):
            cache.k = self.keys[i][row: row + 1, :, :length]  # views: its next step copies them into its own
            cache.v = self.values[i][row: row + 1, :, :length]  # buffers (KVCache.room), before the row is reused
        state.offset = position
        return state

    def clear(self) -> None:
        self.keys, self.values = [], []


def batch_step(model, slots: Slots, tokens: Tensor, lengths: Tensor, positions: Tensor) -> Tensor:
    """Next-token logits (rows, vocab) of running sequences 0 … rows − 1 of ``slots``, each reading
    its token ``tokens`` (rows,) at its position ``positions`` (rows,) after its ``lengths`` (rows,)
    keys, which the step extends by one. The products see all rows at once; attention is one call
    over the rows' keys, each row's masked past its own length; each row's positions are its own
    (an absolute position's vector added, RoPE's angles turned). Equal to each row's own
    ``decode_step`` up to the order of float sums."""
    decoder, cfg = model.decoder, model.cfg
    rows = tokens.size(0)
    x = decoder.embed(tokens[:, None])
    if decoder.positions is not None:
        x = x + torch.cat([decoder.positions(1, int(p)) for p in positions])[:, None]
    if decoder.embed_norm is not None:
        x = decoder.embed_norm(x)
    turn = None
    if decoder.relative is not None:
        cos, sin = decoder.relative.span(0, int(positions.max()) + 1)
        turn = cos[positions][:, None, None], sin[positions][:, None, None]  # (rows, 1, 1, d_k)
    end = int(lengths.max()) + 1
    slots.ensure(rows, end, x)
    mask = (torch.arange(end, device=x.device)[None, :] <= lengths[:, None])[:, None, None]  # (rows, 1, 1, end)
    row_index = torch.arange(rows, device=x.device)
    for i, layer in enumerate(decoder.layers):
        keys, values = slots.keys[i], slots.values[i]

        def attend(y: Tensor, attention=layer.self_attn, keys=keys, values=values):
            q, k, v = attention._split(attention.in_proj(y))
            if turn is not None:
                q, k = (t * turn[0] + rotate_half(t) * turn[1] for t in (q, k))
            keys[row_index, :, lengths] = k[:, :, 0]
            values[row_index, :, lengths] = v[:, :, 0]
            out, _ = scaled_dot_product_attention(q, keys[:rows, :, :end], values[:rows, :, :end], mask,
                                                  scale=attention.scale)
            return attention._output(out, None), None

        x, _ = layer.res_self(x, attend)
        if layer.ffn is not None:
            x, _ = layer.res_ffn(x, lambda y, ffn=layer.ffn: (ffn(y), None))
    if decoder.final_norm is not None:
        x = decoder.final_norm(x)
    if cfg.scale_output:
        x = x * cfg.d_model ** -0.5
    return model.generator(x)[:, 0]


def kernel_step(model, slots: Slots, tokens: Tensor, lengths: Tensor, positions: Tensor, layers: list,
                first: int = 0) -> Tensor:
    """``batch_step`` by matvec.cpp's whole-step kernel (nn/fused.py: a Llama-style decoder on a CPU where it
    compiled), every layer in one call, each row at its own position over its own keys: the sequences of
    the slots' rows ``first`` … ``first + len(tokens) − 1``; ``layers`` the kernel's plan for this many rows
    (``fused.for_kernel``)."""
    from ..nn import fused

    decoder, cfg = model.decoder, model.cfg
    rows = tokens.size(0)
    x = decoder.embed(tokens).contiguous()
    cos, sin = decoder.relative.span(0, int(positions.max()) + 1)
    slots.ensure(first + rows, int(lengths.max()) + 1, x)
    mine = slice(first, first + rows)
    out = fused.run_step(decoder, x, layers, [k[mine] for k in slots.keys], [v[mine] for v in slots.values],
                         lengths.contiguous(), cos[positions].contiguous(), sin[positions].contiguous())
    if decoder.final_norm is not None:
        out = decoder.final_norm(out)
    if cfg.scale_output:
        out = out * cfg.d_model ** -0.5
    return model.generator(out)


@dataclass
class Call:
    """Other work for the model's thread (``Engine.run``), and where its result goes."""

    work: Callable[[], Any]
    done: Callable[[Any, BaseException | None], None]
    cancelled: bool = False


class Engine:
    """The decoding loop of one decoder-only model on a thread of its own; see the module's text.
    ``max_sequences``: sequences decoded together at most; ``max_tokens``: their prompt and new
    tokens together at most; ``max_queue``: requests waiting at most (``QueueFull`` beyond)."""

    def __init__(self, model, max_sequences: int = 32, max_tokens: int = 32768, max_queue: int = 256,
                 name: str = "model", start: Callable[[], None] | None = None):
        self.model, self.max_sequences, self.max_tokens, self.max_queue = model, max_sequences, max_tokens, max_queue
        model.eval()
        self.split = splits(model)
        self.limit = position_limit(model.cfg)
        self.slots = Slots(model) if self.split else None
        self._kernel_layers: dict[tuple[bool, bool], list | None] = {}  # the whole-step kernel's plans, by layout
        self.running: list[Sequence] = []     # in row order
        self._waiting: deque[Sequence] = deque()
        self._calls: deque[Call] = deque()
        self._cv = threading.Condition()
        self._stopping = False
        self.steps = 0                        # batched steps run (for tests and metrics)
        self._thread = threading.Thread(target=self._loop, args=(start,), name=f"engine-{name}", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait()  # ``start`` is done: the engine's thread is ready for requests

    # the owner's side (any thread) ---------------------------------------------------------------

    def __len__(self) -> int:
        """Requests waiting (sequences not yet running, and other work)."""
        return len(self._waiting) + len(self._calls)

    def check(self, sequence: Sequence) -> None:
        """Refuse, in one line, a sequence the engine could never run: no prompt, a negative number of
        new tokens, settings that draw no distribution (``check_sampling``), more tokens than the
        engine holds or than a learned position table has, a prefix's or prompt's virtual places
        (nn/prefix.py) counted."""
        if not sequence.ids:
            raise AtencionError("the prompt has no tokens; give at least one")
        if isinstance(sequence.max_new_tokens, bool) or not isinstance(sequence.max_new_tokens, int) \
                or sequence.max_new_tokens < 0:
            raise AtencionError(f"max_new_tokens must be an integer >= 0, got {sequence.max_new_tokens!r}")
        check_sampling(sequence.temperature, sequence.top_k, sequence.top_p)
        if sequence.tokens > self.max_tokens:
            raise AtencionError(f"{len(sequence.ids)} prompt tokens and {sequence.max_new_tokens} new ones are "
                                f"{sequence.tokens}, more than the {self.max_tokens} the server holds in flight")
        virtual = sum(places(self.model.decoder)) if getattr(self.model, "decoder", None) is not None else 0
        if self.limit is not None and sequence.tokens + virtual > self.limit:
            extra = f" and {virtual} virtual places (prefix or prompt tuning)" if virtual else ""
            raise AtencionError(f"{len(sequence.ids)} prompt tokens and {sequence.max_new_tokens} new ones{extra} "
                                f"are {sequence.tokens + virtual}, more than this model's {self.limit} positions "
                                f"(max_positions)")

    def submit(self, *sequences: Sequence) -> None:
        """Queue ``sequences`` (together: all or none) to join the batch at the next step."""
        for sequence in sequences:
            self.check(sequence)
        with self._cv:
            if len(self) + len(sequences) > self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry shortly")
            self._waiting.extend(sequences)
            self._cv.notify()

    def cancel(self, sequence: Sequence) -> None:
        """End ``sequence`` at the next step (its owner left): its place is freed then."""
        sequence.cancelled = True
        with self._cv:
            self._cv.notify()

    async def run(self, work: Callable[[], Any], timeout_s: float) -> Any:
        """``work()`` on the model's thread, between two steps (as serve/batching.py's Worker runs it):
        QueueFull when ``max_queue`` requests wait, asyncio.TimeoutError after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(result, error) -> None:
            def settle() -> None:
                if not future.done():
                    future.set_exception(error) if error is not None else future.set_result(result)
            loop.call_soon_threadsafe(settle)

        call = Call(work, done)
        with self._cv:
            if len(self) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry shortly")
            self._calls.append(call)
            self._cv.notify()
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            call.cancelled = True
            raise

    def stop(self, timeout: float = 60.0) -> None:
        """Finish what runs and waits, then end the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # the model's thread --------------------------------------------------------------------------

    def _loop(self, start: Callable[[], None] | None) -> None:
        try:
            if start is not None:  # the thread's own settings (torch threads) and warm-up, first
                start()
        except Exception:  # noqa: BLE001 - a warm-up that fails must not stop the model's thread
            log.exception("the engine's start failed")
        finally:
            self._ready.set()
        while True:
            with self._cv:
                while not (self._waiting or self._calls or self.running or self._stopping):
                    self._cv.wait()
                if self._stopping and not (self._waiting or self._calls or self.running):
                    return
                calls, joining = list(self._calls), self._admit()
                self._calls.clear()
            for call in calls:
                self._call(call)
            try:
                with torch.inference_mode():
                    self._turn(joining)
            except BaseException as err:  # noqa: BLE001 - every sequence must hear back, whatever happened
                log.exception("a decoding step failed")
                for sequence in dict.fromkeys([*joining, *self.running]):
                    if not sequence.ended:
                        self._tell(sequence, Event(error=err))
                self.running = []
                if self.slots is not None:
                    self.slots.clear()

    def _admit(self) -> list[Sequence]:
        """The waiting sequences that fit now, first come first served (one that does not fit waits,
        and so do those behind it); cancelled ones are dropped."""
        joining: list[Sequence] = []
        held = sum(s.tokens for s in self.running)
        while self._waiting:
            sequence = self._waiting[0]
            if sequence.cancelled:
                self._waiting.popleft()
                self._tell(sequence, Event(finish="cancelled"))
                continue
            if len(self.running) + len(joining) >= self.max_sequences or held + sequence.tokens > self.max_tokens:
                break
            joining.append(self._waiting.popleft())
            held += sequence.tokens
        return joining

    def _call(self, call: Call) -> None:
        """Other work, its result or exception handed to its caller; a caller that is gone (its
        event loop closed) is logged, and the loop goes on."""
        if call.cancelled:
            return
        try:
            result, error = call.work(), None
        except BaseException as err:  # noqa: BLE001 - its caller hears of it
            result, error = None, err
        try:
            call.done(result, error)
        except RuntimeError:  # its loop closed meanwhile (it timed out and left)
            log.warning("work for the model's thread finished after its caller left")

    def _turn(self, joining: list[Sequence]) -> None:
        """One turn of the loop: the cancelled leave, the joining are read (their first token chosen
        from it), then one step of every running sequence, the joined ones included."""
        for sequence in [s for s in self.running if s.cancelled]:
            self._end(sequence, Event(finish="cancelled"))
        for sequence in joining:
            self._join(sequence)
        stepping = list(self.running)
        if not stepping:
            if self.slots is not None:
                self.slots.clear()  # nothing runs: the buffers go
            return
        if not self.split:
            logits = torch.cat([self._own_step(s) for s in stepping])
        elif len(stepping) == 1:
            sequence = stepping[0]
            if sequence.state is None:  # alone again: its row as caches of its own
                sequence.state = self.slots.state(self.model, 0, sequence.length, sequence.position)
            logits = self._own_step(sequence)
        else:
            logits = self._batch_step(stepping)
        for sequence in stepping:  # (all of them before any leaves: a row moved on leaving takes its new key)
            sequence.length += 1
            sequence.position += 1
        for sequence, row in zip(stepping, logits):
            self._choose(sequence, row[None])

    def _own_step(self, sequence: Sequence) -> Tensor:
        """A sequence's step by the model's own ``decode_step`` on its own caches: logits (1, vocab)."""
        ids = torch.tensor([[sequence.last]], device=_device(self.model))
        return self.model.decode_step(ids, sequence.state)[:, -1]

    def _batch_step(self, stepping: list[Sequence]) -> Tensor:
        """One step of the running sequences, rows 0 … of the slots (``batch_step``); a sequence with
        caches of its own until now (it ran alone, or just joined) moves them into its row first."""
        for row, sequence in enumerate(stepping):
            if sequence.state is not None:
                self.slots.put(row, sequence.state)
                sequence.state = None
        device = _device(self.model)
        tokens = torch.tensor([s.last for s in stepping], device=device)
        lengths = torch.tensor([s.length for s in stepping], device=device)
        positions = torch.tensor([s.position for s in stepping], device=device)
        self.steps += 1
        rows = len(stepping)
        parts = -(-rows // PANEL_ROWS)  # the kernel takes up to PANEL_ROWS rows: more in parts of equal size
        plans = [self._kernel_plan(part.stop - part.start) for part in _parts(rows, parts)]
        if any(plan is None for plan in plans):
            return batch_step(self.model, self.slots, tokens, lengths, positions)
        return torch.cat([kernel_step(self.model, self.slots, tokens[part], lengths[part], positions[part], plan,
                                      part.start) for part, plan in zip(_parts(rows, parts), plans)])

    def _kernel_plan(self, rows: int) -> list | None:
        """The whole-step kernel's layers for ``rows`` rows (made once per layout, kept), or None where it
        does not apply (nn/fused.py ``plan``: not a Llama-style decoder in float32 or int8 on a CPU where
        the kernels compiled, ATENCION_FUSED=0); at most ``PANEL_ROWS`` rows."""
        from ..nn import fused, matvec

        if _device(self.model).type != "cpu":
            return None
        key = fused.layout(rows) if matvec.kernel() is not None else (False, False)
        if key not in self._kernel_layers:
            planned = fused.plan(self.model.decoder, rows)
            self._kernel_layers[key] = None if planned is None else fused.for_kernel(planned)
        return self._kernel_layers[key]

    def _join(self, sequence: Sequence) -> None:
        """Read the prompt whole (``decode_step`` on caches of its own), choose the first token."""
        device = _device(self.model)
        ids = torch.tensor([sequence.ids], device=device)
        state = self.model.init_state()
        scored = sequence.prompt_logprobs is not None
        try:
            logits = self.model.decode_step(ids, state, last=None if scored else 1)
        except AtencionError as err:
            self._end(sequence, Event(error=err), running=False)
            return
        if scored:
            self._tell(sequence, Event(prompt=_prompt_logprobs(logits[0], sequence.ids, sequence.prompt_logprobs)))
        sequence.state, sequence.length, sequence.position = state, len(state.self_caches[0]), state.offset
        if sequence.max_new_tokens == 0:
            self._end(sequence, Event(finish="length"), running=False)
            return
        self.running.append(sequence)
        self._choose(sequence, logits[:, -1])

    def _choose(self, sequence: Sequence, logits: Tensor) -> None:
        """The next token of ``sequence`` from its logits (1, vocab); told to its owner; the end when
        it is a stop token or the last one allowed."""
        if sequence.logits is not None:
            sequence.logits.append(logits[0].float().clone())
        if is_greedy(sequence.temperature, sequence.top_k):
            token = int(logits.argmax(dim=-1))
        else:
            token = int(choose_next(logits, sequence.temperature, sequence.top_k, sequence.top_p,
                                    sequence.generator))
        event = Event(token=token)
        if sequence.logprobs is not None:
            logprobs = logits[0].float().log_softmax(dim=-1)
            event.logprob, event.top = float(logprobs[token]), _top(logprobs, sequence.logprobs)
        self._tell(sequence, event)
        sequence.new += 1
        sequence.last = token
        if token in sequence.stop_ids:
            self._end(sequence, Event(finish="stop"))
        elif sequence.new >= sequence.max_new_tokens:
            self._end(sequence, Event(finish="length"))

    def _end(self, sequence: Sequence, event: Event, running: bool = True) -> None:
        """Tell the owner how ``sequence`` ended and give its row to the last running sequence."""
        if running and sequence in self.running:
            row = self.running.index(sequence)
            last = len(self.running) - 1
            if row != last and self.running[last].state is None:
                self.slots.move(last, row, self.running[last].length)
            self.running[row] = self.running[last]
            self.running.pop()
        sequence.state = None
        sequence.ended = True
        self._tell(sequence, event)

    @staticmethod
    def _tell(sequence: Sequence, event: Event) -> None:
        """``on_event``; what its owner raises is logged, and the loop goes on for the others."""
        if event.finish is not None or event.error is not None:
            sequence.ended = True
        try:
            sequence.on_event(event)
        except Exception:  # noqa: BLE001 - an owner's fault must not stop the model's thread
            log.exception("a sequence's owner failed on its event")


def _parts(rows: int, parts: int) -> list[slice]:
    """``rows`` rows in ``parts`` runs of sizes that differ by one at most."""
    bounds = [round(i * rows / parts) for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def _device(model) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _top(logprobs: Tensor, count: int) -> list[tuple[int, float]]:
    """The ``count`` most likely tokens and their log-probabilities."""
    if count <= 0:
        return []
    values, index = logprobs.topk(min(count, logprobs.size(-1)))
    return [(int(i), float(v)) for i, v in zip(index, values)]


def _prompt_logprobs(logits: Tensor, ids: list[int], count: int) -> list[tuple[float | None, list[tuple[int, float]]]]:
    """Each prompt token's log-probability given the tokens before it (None for the first, which
    follows nothing) and the ``count`` most likely tokens there."""
    logprobs = logits.float().log_softmax(dim=-1)
    scored: list[tuple[float | None, list[tuple[int, float]]]] = [(None, [])]
    for i in range(1, len(ids)):
        scored.append((float(logprobs[i - 1, ids[i]]), _top(logprobs[i - 1], count)))
    return scored
