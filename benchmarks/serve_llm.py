"""`atencion serve` as an OpenAI server under streaming load, against llama.cpp's server on the same
weights: throughput, time to first token and inter-token latency at 1 to 32 concurrent streams.

    python -m benchmarks.serve_llm --llama-server PATH              # the tables (about an hour on 2 cores)
    python -m benchmarks.serve_llm --json serve_llm.json            # also every figure and setting
    python -m benchmarks.serve_llm --clients 1,16 --rounds 5 --threads 2
    python -m benchmarks.serve_llm --engines atencion,atencion-seq1 # atencion alone
    python -m benchmarks.serve_llm --smoke                          # seconds: a check, not a result

The weights: a Llama of SmolLM-135M's shape (preset ``smollm-135m``: 30 layers, d_model 576, 9 heads,
3 key/value heads, a 49,152-token vocabulary; --preset, --layers, --vocab) with random weights
(speed.py's ``lm_models``), saved as an atencion model directory with a character vocabulary of the
model's size (one character a token, the vocabulary speed.py's ``gguf_exports`` writes into its
GGUF files), and exported to GGUF float32 and q8_0 by ``gguf_exports``. Each engine is a server
started here (127.0.0.1, a free port, its log in a temporary file), waited for and always stopped
at the end, on an error or Ctrl-C too:
- atencion: ``python -m atencion serve --model DIR --threads T``, float32, continuous batching on
  (its default --max-sequences, 32); atencion-int8: the same with ``--int8``;
- atencion-seq1: the same with ``--max-sequences 1``: continuous batching off, one sequence at a time;
- llama-server-f32 and llama-server-q8_0: llama.cpp's own server (its tools/server, built from
  llama.cpp's source: --llama-server PATH, $LLAMA_SERVER or llama-server on PATH; opt-in, its rows
  left out without it) on atencion's GGUF exports, with ``--parallel`` slots as many as the widest
  phase's streams and continuous batching (``--cont-batching``), threads as atencion's;
  ``--llama-server-args=--no-repack`` adds options (there, where its repacked weights fail);
- llama.cpp-f32 and llama.cpp-q8_0: llama-cpp-python's OpenAI server (``python -m llama_cpp.server
  --model model-f32.gguf --n_threads T --n_threads_batch T --n_ctx N --interrupt_requests False
  --logits_all False``), opt-in: where ``llama_cpp`` is not installed one line says so and their rows
  are left out. That server decodes one request at a time (it has no continuous batching; with its
  default --interrupt_requests a new request would cut the one streaming): llama-server is the peer
  under concurrency. On a CPU with AMX its models load without llama.cpp's extra buffer types
  (--llama-extra-bufts; its command line has no such option, so the script sets it before running
  the server's module): llama.cpp 0.3.36's q8_0 server died of a segmentation fault on the first
  request through them here, as speed.py found.
`generate` is atencion's ``generate_ids`` in this process on the same model directory (its kernels
warmed as the server warms them), one stream: what the 1-stream rows compare with (the target: the
server's single stream within 10% of generate alone).

Load: for each --clients count C (default 1,4,16,32), C streaming clients at once through the
official ``openai`` SDK (AsyncOpenAI on an httpx client that ignores proxy settings, no retries),
each one /v1/completions request: ``stream=True``, ``temperature 0``, ``max_tokens`` --new-tokens
(128), its prompt 32 random token ids (--prompt-tokens) sent as their text (a character each; the
llama.cpp server reads no token ids). Every stream of the run has a prompt of its own (round,
count, client), the same for every engine: llama-cpp-python reuses the key/value cache of a prompt
that starts like the last one, which would skip its prefill. Prompts are drawn so that atencion's
greedy continuation holds no special token (llama.cpp stops at its end-of-text token, atencion's
own tokenizer has no stop token), so that each engine generates the same --new-tokens tokens; a
stream that ended short is counted. The llama.cpp requests add ``repeat_penalty: 1`` (its server's
default 1.1 would change the greedy choice).
Figures of a phase (one engine, one count, one round): tok/s = completion tokens (the usage chunk
where the server sends one, else the chunks with text: one token each here) over the phase's wall
time (from the first request to the last stream's end); TTFT: from a request to its first text;
ITL: the gaps between a stream's chunks of text. The engines take turns within each round, in the
reverse order every other round, --rounds rounds (3); a table per count gives each engine's tok/s
median (min-max over the rounds), TTFT p50 and ITL p50/p99 pooled over the rounds, streams and
errors, and the ratios of the rounds (median, min-max): atencion / llama-server-f32, atencion-int8 /
llama-server-q8_0, the same against llama.cpp-f32 and -q8_0, atencion / atencion-seq1 (continuous
batching's gain; the figure of interest at 16 streams), and at 1 stream atencion / generate.
Greedy check: at temperature 0 the float32 engines should write the same text for the same prompt:
the share of each engine's streams equal to atencion's single-stream answer (atencion-seq1's, which
decodes every stream alone; llama.cpp's float32 may differ in the last bits, q8_0 more).

It names the CPU (/proc/cpuinfo's model name), its vector width (AVX-512 where avx512f is listed,
else AVX2) and the threads of each server (--threads, default: the CPUs this process may use); the
clients run in this process and share the CPUs with the server, as local clients would. Each
phase has a hard time limit (--phase-limit: its unfinished streams are cut and counted as errors),
as has each server's start; a llama.cpp server that fails to start or dies is left out, in one
line. --json FILE writes every figure and setting. The exit status is 1 when an atencion stream
failed, else 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

from atencion.nn.matvec import Cpu
from benchmarks.common import ROOT, SMOKE_HELP, free_port, installed, spread
from benchmarks.serve_load import cpu_count, cpu_seconds, percentile
from benchmarks.speed import LLAMA_VOCAB, gguf_exports, lm_models

KIND = "speed"  # a speed (and load) benchmark (benchmarks/__init__.py lists the two groups)
HOST = "127.0.0.1"  # loopback only, always
ENGINES = ("atencion", "atencion-int8", "atencion-seq1", "llama-server-f32", "llama-server-q8_0", "llama.cpp-f32",
           "llama.cpp-q8_0")
GENERATE = "generate"  # atencion's generate_ids in this process, 1 stream
RATIOS = (("atencion", "llama-server-f32"), ("atencion-int8", "llama-server-q8_0"), ("atencion", "llama.cpp-f32"),
          ("atencion-int8", "llama.cpp-q8_0"), ("atencion", "atencion-seq1"), ("atencion", GENERATE))
START_LIMIT = 300.0  # seconds for a server to answer, at least (--phase-limit where longer)
# llama-cpp-python's server (`python -m llama_cpp.server`) with its models loaded without llama.cpp's extra buffer
# types (weight repacking, AMX), which its command line cannot ask for: on a CPU with AMX, llama.cpp 0.3.36's q8_0
# products through them crash (a protection fault in libggml-cpu; speed.py's llama_cpp_engine turns them off too)
WITHOUT_EXTRA_BUFTS = """
import runpy
import llama_cpp.llama_cpp as lib
defaults = lib.llama_model_default_params
def without_extra_bufts():
    params = defaults()
    params.use_extra_bufts = False
    return params
lib.llama_model_default_params = without_extra_bufts
runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
"""


# the machine -----------------------------------------------------------------------------------

def cpu_info() -> dict:
    """The CPU's model name and vector width, from /proc/cpuinfo (lscpu where it has no model name)."""
    name, flags = None, set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name is None:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    if name is None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
            name = next((line.split(":", 1)[1].strip() for line in out.splitlines()
                         if line.startswith("Model name")), None)
    width = Cpu(name or "", tuple(sorted(flags))).vector_width
    return {"model_name": name or platform.processor() or "unknown", "vector_width": width,
            "avx512f": "avx512f" in flags, "avx2": "avx2" in flags, "amx": "amx_tile" in flags,
            "cpus": cpu_count()}


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


# the weights and the prompts -------------------------------------------------------------------

def char_tokenizer(vocab_size: int):
    """The character vocabulary of ``gguf_exports``: the special tokens, then one character a token
    (U+10000 on), so that the model directory and the GGUF files read and write the same text."""
    from atencion.data.tokenizer import SPECIALS, CharVocab, Tokenizer

    return Tokenizer(CharVocab([*SPECIALS, *(chr(0x10000 + i) for i in range(vocab_size - len(SPECIALS)))]))


def build(args, work: Path, with_gguf: bool) -> tuple[Path, Path | None, str]:
    """The model directory (and the GGUF files when ``with_gguf``) of a random Llama of --preset; its shape."""
    from atencion.nn.model_dir import save_model_dir

    overrides = {"n_layers": args.layers} if args.layers else {}
    ours, hf = lm_models(args.preset, args.vocab, **overrides)
    del hf  # lm_models gives Hugging Face's copy too; only atencion's weights are used
    ours.eval()
    model_dir = work / "model"
    save_model_dir(model_dir, ours, char_tokenizer(ours.cfg.vocab_size))
    gguf_dir = gguf_exports(ours, work / "gguf") if with_gguf else None
    cfg = ours.cfg
    shape = (f"{args.preset}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, {cfg.kv_heads} "
             f"key/value heads, d_ff {cfg.d_ff}, vocab {cfg.vocab_size}, "
             f"{sum(p.numel() for p in ours.parameters()) / 1e6:.1f}M parameters, random weights")
    return model_dir, gguf_dir, shape


class Prompts:
    """A prompt of its own for every stream (round, count, client): --prompt-tokens random ids
    past the special tokens, redrawn while atencion's greedy continuation (``generate_ids``, in
    batches) holds a special token."""

    def __init__(self, model, tokenizer, length: int, new: int, seed: int = 0):
        from atencion.data.tokenizer import SPECIALS

        self.model, self.tokenizer, self.length, self.new = model, tokenizer, length, new
        self.first, self.vocab = len(SPECIALS), model.cfg.vocab_size
        self.rng = random.Random(seed)
        self.ids: dict[tuple[int, int, int], list[int]] = {}
        self.redrawn = 0

    def draw(self, keys: list[tuple[int, int, int]], batch: int = 32) -> None:
        import torch

        from atencion.decode.sample import generate_ids

        todo = list(keys)
        for _ in range(20):
            if not todo:
                return
            drawn = {k: [self.rng.randrange(self.first, self.vocab) for _ in range(self.length)] for k in todo}
            bad = []
            for i in range(0, len(todo), batch):
                part = todo[i:i + batch]
                made = generate_ids(self.model, torch.tensor([drawn[k] for k in part]), self.new, temperature=0.0)
                for k, row in zip(part, made.tolist()):
                    if min(row) < self.first:
                        bad.append(k)
                    else:
                        self.ids[k] = drawn[k]
            self.redrawn += len(bad)
            todo = bad
        for k in todo:  # 20 draws in a row: keep the last (its stream may end short, and is counted so)
            self.ids[k] = drawn[k]

    def text(self, key: tuple[int, int, int]) -> str:
        return self.tokenizer.decode(self.ids[key])


# the servers -----------------------------------------------------------------------------------

class Server:
    """A server subprocess on 127.0.0.1 (its log in a file), up once ``ready`` answers 200."""

    def __init__(self, name: str, command: list[str], port: int, ready: str, log_dir: Path,
                 extra_body: dict | None = None):
        self.name, self.command, self.port, self.ready = name, command, port, ready
        self.url = f"http://{HOST}:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.extra_body = extra_body or {}
        self.proc: subprocess.Popen | None = None
        self.model = "model"  # the name its /v1/models gives (read once it is up)
        self.startup_s: float | None = None
        self.began = 0.0

    def launch(self) -> None:
        self.began = time.perf_counter()
        with open(self.log_path, "wb") as log:  # the server keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=ROOT)

    def wait(self, limit: float) -> None:
        """Wait for ``ready`` (200) within ``limit`` seconds of the launch; then read the model's name."""
        import httpx

        with httpx.Client(base_url=self.url, trust_env=False, timeout=5.0) as client:
            while time.perf_counter() - self.began < limit:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name}: the server exited with status {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.get(self.ready).status_code == 200:
                        self.startup_s = time.perf_counter() - self.began
                        self.model = client.get("/v1/models").json()["data"][0]["id"]
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"{self.name}: no answer on {self.ready} within {limit:g} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def servers(args, engines: list[str], model_dir: Path, gguf_dir: Path | None, log_dir: Path) -> list[Server]:
    out = []
    biggest = max(args.clients)
    for name in engines:
        port = free_port()
        if name.startswith("atencion"):
            command = [sys.executable, "-m", "atencion", "serve", "--model", str(model_dir), "--host", HOST,
                       "--port", str(port), "--threads", str(args.threads),
                       "--max-new-tokens", str(max(512, args.new_tokens)), "--max-queue", str(max(256, biggest)),
                       "--timeout", str(min(3600.0, args.phase_limit))]
            if name == "atencion-seq1":
                command += ["--max-sequences", "1"]
            if name == "atencion-int8":
                command += ["--int8"]
            out.append(Server(name, command, port, "/health", log_dir))
        elif name.startswith("llama-server"):
            kind = name.split("-", 2)[2]
            per_slot = args.prompt_tokens + args.new_tokens + 64
            command = [args.llama_server, "--model", str(gguf_dir / f"model-{kind}.gguf"), "--host", HOST,
                       "--port", str(port), "--threads", str(args.threads), "--threads-batch", str(args.threads),
                       "--parallel", str(biggest), "--ctx-size", str(biggest * per_slot), "--cont-batching",
                       *args.llama_server_args.split()]
            out.append(Server(name, command, port, "/health", log_dir, extra_body={"repeat_penalty": 1.0}))
        else:
            kind = name.split("-", 1)[1]
            start = ["-m", "llama_cpp.server"] if args.llama_extra_bufts else ["-c", WITHOUT_EXTRA_BUFTS]
            command = [sys.executable, *start, "--model", str(gguf_dir / f"model-{kind}.gguf"), "--host", HOST,
                       "--port", str(port), "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads),
                       "--n_ctx", str(args.prompt_tokens + args.new_tokens + 64),
                       "--interrupt_requests", "False", "--logits_all", "False", "--verbose", "False"]
            out.append(Server(name, command, port, "/v1/models", log_dir, extra_body={"repeat_penalty": 1.0}))
    return out


# the load --------------------------------------------------------------------------------------

async def one_stream(client, server: Server, prompt: str, new: int) -> dict:
    """One streaming completion: its tokens, text, time to first text, gaps between texts, end."""
    began = time.perf_counter()
    stamps, pieces, usage, finish, error = [], [], None, None, None
    try:
        stream = await client.completions.create(model=server.model, prompt=prompt, max_tokens=new, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=server.extra_body or None)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.text:
                    stamps.append(now)
                    pieces.append(choice.text)
                if choice.finish_reason:
                    finish = choice.finish_reason
    except Exception as err:  # noqa: BLE001 - a failed stream is counted (openai.APIError and the rest), never raised
        error = f"{type(err).__name__}: {str(err)[:200]}"
    ended = time.perf_counter()
    tokens = usage if usage is not None else len(pieces)
    return {"tokens": tokens, "counted_by": "usage" if usage is not None else "chunks", "text": "".join(pieces),
            "ttft": stamps[0] - began if stamps else None, "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
            "finish": finish, "error": error, "ended": ended}


async def phase(server: Server, prompts: list[str], new: int, limit: float) -> dict:
    """len(prompts) clients at once, one streaming request each, within ``limit`` seconds."""
    import httpx2
    import openai

    n = len(prompts)
    http = openai.DefaultAsyncHttpxClient(trust_env=False, timeout=httpx2.Timeout(limit + 10),
                                          limits=httpx2.Limits(max_connections=n + 8, max_keepalive_connections=n + 8))
    cpu_before = cpu_seconds(server.proc.pid) if server.proc else None
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, http_client=http,
                                  timeout=limit + 10) as client:
        began = time.perf_counter()
        tasks = [asyncio.ensure_future(one_stream(client, server, p, new)) for p in prompts]
        done, pending = await asyncio.wait(tasks, timeout=limit)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
    streams = [t.result() if t in done else None for t in tasks]
    ok = [s for s in streams if s is not None and s["error"] is None]
    end = max((s["ended"] for s in ok), default=time.perf_counter()) if not pending else began + limit
    wall = max(end - began, 1e-9)
    tokens = sum(s["tokens"] for s in ok)
    cpu_after = cpu_seconds(server.proc.pid) if server.proc else None
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "streams": n, "ok": len(ok),
            "errors": n - len(ok), "error_kinds": sorted({s["error"].split(":")[0] for s in streams if s and s["error"]}
                                                         | ({"cut by --phase-limit"} if pending else set())),
            "short": sum(s["tokens"] < new for s in ok), "finish": sorted({str(s["finish"]) for s in ok}),
            "counted_by": sorted({s["counted_by"] for s in ok}),
            "server_cpu_cores": (cpu_after - cpu_before) / wall if cpu_before is not None and cpu_after else None,
            "ttft": [s["ttft"] for s in ok if s["ttft"] is not None], "gaps": [g for s in ok for g in s["gaps"]],
            "texts": [s["text"] if s is not None and s["error"] is None else None for s in streams]}


def generate_phase(model, tokenizer, ids: list[int], new: int) -> dict:
    """One stream of ``generate_ids`` in this process: the same figures as a server's phase."""
    import torch

    from atencion.decode.sample import generate_ids
    from atencion.tasks.lm import render

    stamps: list[float] = []
    began = time.perf_counter()
    made = generate_ids(model, torch.tensor([ids]), new, temperature=0.0,
                        on_step=lambda step, tokens: stamps.append(time.perf_counter()))
    wall = stamps[-1] - began
    return {"tok_s": made.size(1) / wall, "tokens": made.size(1), "wall_s": wall, "streams": 1, "ok": 1,
            "errors": 0, "error_kinds": [], "short": int(made.size(1) < new), "finish": ["length"],
            "counted_by": ["tokens"], "server_cpu_cores": None, "ttft": [stamps[0] - began],
            "gaps": [b - a for a, b in zip(stamps, stamps[1:])], "texts": [render(tokenizer, made[0].tolist())]}


# the report ------------------------------------------------------------------------------------

def ms(seconds: list[float], q: float) -> float | None:
    value = percentile(seconds, q)
    return None if value is None else round(1000 * value, 2)


def summarize(results: dict, engines: list[str], counts: list[int]) -> dict:
    """Per count: each engine's tok/s spread over the rounds, pooled latencies, counts; the ratios."""
    out = {}
    for c in counts:
        rows = {}
        for engine in engines + [GENERATE]:
            runs = results.get((engine, c), [])
            if not runs:
                continue
            ttft = [x for r in runs for x in r["ttft"]]
            gaps = [x for r in runs for x in r["gaps"]]
            rows[engine] = {"tok_s": spread([r["tok_s"] for r in runs], 2), "tok_s_rounds": [r["tok_s"] for r in runs],
                            "ttft_p50_ms": ms(ttft, 50), "itl_p50_ms": ms(gaps, 50), "itl_p99_ms": ms(gaps, 99),
                            "streams": sum(r["streams"] for r in runs), "ok": sum(r["ok"] for r in runs),
                            "errors": sum(r["errors"] for r in runs), "short": sum(r["short"] for r in runs),
                            "tokens": sum(r["tokens"] for r in runs), "itl_samples": len(gaps),
                            "error_kinds": sorted({k for r in runs for k in r["error_kinds"]}),
                            "finish": sorted({k for r in runs for k in r["finish"]}),
                            "counted_by": sorted({k for r in runs for k in r["counted_by"]}),
                            "server_cpu_cores": [r["server_cpu_cores"] for r in runs]}
        ratios = {}
        for ours, theirs in RATIOS:
            key = f"{ours} / {theirs}"
            a, b = results.get((ours, c), []), results.get((theirs, c), [])
            per_round = [x["tok_s"] / y["tok_s"] for x, y in zip(a, b) if x["tok_s"] > 0 and y["tok_s"] > 0]
            ratios[key] = spread(per_round, 3) if per_round else None
        out[str(c)] = {"engines": rows, "ratios": ratios}
    return out


def agreement(texts: dict, engines: list[str]) -> dict:
    """The share of each engine's streams whose text is atencion-seq1's for the same prompt."""
    reference = texts.get("atencion-seq1", {})
    out = {}
    for engine in engines + [GENERATE]:
        pairs = [(t, reference[k]) for k, t in texts.get(engine, {}).items()
                 if t is not None and reference.get(k) is not None]
        if pairs:
            out[engine] = {"same": sum(a == b for a, b in pairs) / len(pairs), "streams": len(pairs)}
    return out


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: dict) -> None:
    s, m = report["settings"], report["machine"]
    print(f"\natencion serve (OpenAI protocol) under streaming load | {report['model']}")
    print(f"CPU: {m['model_name']}, {m['cpus']} CPUs here, vector width {m['vector_width']}"
          f"{' (AMX too)' if m['amx'] else ''} | server threads {s['threads']} (the clients share this machine)")
    print(f"{s['prompt_tokens']} prompt tokens + {s['new_tokens']} new, greedy, streaming; {s['rounds']} round(s); "
          f"prompts redrawn for a special token in atencion's continuation: {report['prompts_redrawn']}")
    for name, why in report["skipped"].items():
        print(f"skipped: {name} ({why})")
    for c, table in report["by_clients"].items():
        print(f"\n{c} stream{'s' if c != '1' else ''}")
        print(f"{'engine':<16}{'tok/s':>9}{'(min-max)':>17}{'TTFT p50 ms':>13}{'ITL p50 ms':>12}{'ITL p99 ms':>12}"
              f"{'streams':>9}{'errors':>8}{'short':>7}")
        for engine, r in table["engines"].items():
            t = r["tok_s"]
            span = f"{fmt(t['min'])}-{fmt(t['max'])}"
            print(f"{engine:<16}{fmt(t['median']):>9}{span:>17}{fmt(r['ttft_p50_ms']):>13}{fmt(r['itl_p50_ms'], 2):>12}"
                  f"{fmt(r['itl_p99_ms'], 2):>12}{r['streams']:>9}{r['errors']:>8}{r['short']:>7}")
        for engine, r in table["engines"].items():
            if r["errors"]:
                print(f"  {engine}: {r['errors']} stream(s) failed: {', '.join(r['error_kinds'])}")
        for key, value in table["ratios"].items():
            if value is None:
                continue
            shown = value if isinstance(value, str) else \
                f"{value['median']:.2f}x ({value['min']:.2f}-{value['max']:.2f}, {value['runs']} rounds)"
            print(f"  {key}: {shown}")
    print("\ngreedy agreement with atencion's single-stream text (atencion-seq1's), share of streams:")
    print("  " + ", ".join(f"{e} {a['same']:.3f} of {a['streams']}" + (" (itself)" if e == "atencion-seq1" else "")
                           for e, a in report["agreement"].items()))
    one = report["by_clients"].get("1", {}).get("ratios", {}).get(f"atencion / {GENERATE}")
    if isinstance(one, dict):
        print(f"1 stream, atencion serve / generate alone: {one['median']:.2f}x (target: >= 0.90)")
    gain = report["by_clients"].get("16", {}).get("ratios", {}).get("atencion / atencion-seq1")
    if isinstance(gain, dict):
        print(f"16 streams, continuous batching on / off: {gain['median']:.2f}x")


# main ------------------------------------------------------------------------------------------

def run(args, engines: list[str], work: Path, report: dict) -> dict:
    import torch

    from atencion.nn import fused, matvec
    from atencion.nn.model_dir import load_model_dir

    began = time.perf_counter()
    llama = any(e.startswith("llama") for e in engines)
    model_dir, gguf_dir, report["model"] = build(args, work, llama)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_dir(model_dir)  # as the server reads it
    matvec.warm(model)
    fused.warm(model)  # as the server does before it listens (serve/app.py warm)
    prompts = Prompts(model, tokenizer, args.prompt_tokens, args.new_tokens)
    keys = {(r, c): [(r, c, k) for k in range(c)] for r in range(args.rounds) for c in args.clients}
    prompts.draw([k for ks in keys.values() for k in ks])
    report["prompts_redrawn"] = prompts.redrawn
    print(f"model and prompts ready in {time.perf_counter() - began:.0f} s; starting {', '.join(engines)}",
          file=sys.stderr, flush=True)

    results: dict[tuple[str, int], list[dict]] = {}
    texts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="serve_llm_logs_") as logs, contextlib.ExitStack() as stack:
        up = servers(args, engines, model_dir, gguf_dir, Path(logs))
        for server in up:
            stack.callback(server.stop)  # every server stops, whatever happens
            server.launch()
        for server in list(up):
            try:
                server.wait(max(START_LIMIT, args.phase_limit))
            except RuntimeError as err:
                if server.name.startswith("atencion"):
                    raise
                server.stop()  # llama.cpp is opt-in: its rows are left out, the rest goes on
                up.remove(server)
                report["skipped"][server.name] = f"its server did not start: {str(err).splitlines()[0]}"
                print(f"  {err}", file=sys.stderr, flush=True)
                continue
            print(f"  {server.name} up on {server.url} in {server.startup_s:.1f} s", file=sys.stderr, flush=True)
        report["startup_s"] = {s.name: s.startup_s for s in up}
        shown = "<python -m llama_cpp.server, models loaded with use_extra_bufts=False>"  # for WITHOUT_EXTRA_BUFTS
        report["commands"] = {s.name: s.command[:2] + [shown] + s.command[3:] if s.command[1] == "-c" else s.command
                              for s in up}
        warm_prompt = prompts.text((0, args.clients[0], 0))
        for server in up:  # warm-up: a lone stream, then a burst as wide as the widest phase, a few tokens each
            asyncio.run(phase(server, [warm_prompt], min(8, args.new_tokens), args.phase_limit))
            asyncio.run(phase(server, [warm_prompt] * max(args.clients), 4, args.phase_limit))
        generate_phase(model, tokenizer, prompts.ids[(0, args.clients[0], 0)], min(8, args.new_tokens))
        down: set[str] = set()
        for r in range(args.rounds):
            order = up if r % 2 == 0 else up[::-1]
            for c in args.clients:
                batch = [prompts.text(k) for k in keys[(r, c)]]
                turns = [*order, GENERATE] if c == 1 and r % 2 == 0 else [GENERATE, *order] if c == 1 else order
                for server in turns:
                    if server == GENERATE:
                        name, result = GENERATE, generate_phase(model, tokenizer, prompts.ids[keys[(r, c)][0]],
                                                                args.new_tokens)
                    else:
                        name = server.name
                        if name in down:
                            continue
                        result = asyncio.run(phase(server, batch, args.new_tokens, args.phase_limit))
                        if not server.alive():
                            down.add(name)
                            print(f"  {name}: the server died (status {server.proc.returncode}); its later phases "
                                  f"are left out:\n{server.log_tail()}", file=sys.stderr, flush=True)
                    for key, text in zip(keys[(r, c)], result.pop("texts")):
                        texts.setdefault(name, {})[key] = text
                    results.setdefault((name, c), []).append({**result, "round": r})
                    print(f"  round {r + 1}/{args.rounds}, {c:>2} stream(s), {name:<15} {result['tok_s']:8.1f} tok/s"
                          f"  TTFT p50 {fmt(ms(result['ttft'], 50))} ms  ITL p50 {fmt(ms(result['gaps'], 50), 2)} ms"
                          f"  errors {result['errors']}", file=sys.stderr, flush=True)
        report["died"] = sorted(down)
    report["by_clients"] = summarize(results, engines, args.clients)
    report["rounds"] = {f"{e} x{c}": [{k: v for k, v in x.items() if k not in ("ttft", "gaps")} for x in runs]
                        for (e, c), runs in results.items()}
    report["agreement"] = agreement(texts, engines)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm-135m", help="the model's preset (default: smollm-135m)")
    parser.add_argument("--vocab", type=int, default=LLAMA_VOCAB, help=f"its vocabulary (default: {LLAMA_VOCAB})")
    parser.add_argument("--layers", type=int, default=0, help="its layers (default: the preset's)")
    parser.add_argument("--clients", default="1,4,16,32",
                        help="concurrent streams of each phase, comma-separated (default: 1,4,16,32)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every engine and count (default: 3)")
    parser.add_argument("--new-tokens", type=int, default=128, help="max_tokens of each request (default: 128)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="tokens of each prompt (default: 32)")
    parser.add_argument("--threads", type=int, default=cpu_count(),
                        help=f"each server's threads, and generate's (default: the CPU count, {cpu_count()} here)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help=f"the servers to time, comma-separated (default: all, {','.join(ENGINES)}; "
                             f"atencion-seq1 gives the greedy reference and is always run)")
    parser.add_argument("--llama-extra-bufts", choices=("auto", "on", "off"), default="auto",
                        help="llama.cpp's extra buffer types (weight repacking, AMX): auto is off on a CPU with AMX, "
                             "where llama.cpp 0.3.36's q8_0 crashed through them, else on, llama.cpp's default")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
                        help="llama.cpp's own server binary (its tools/server, built from llama.cpp's source): the "
                             "llama-server rows, with --parallel as many slots as the widest phase and continuous "
                             "batching (default: $LLAMA_SERVER, else llama-server on PATH; none: left out)")
    parser.add_argument("--llama-server-args", default="",
                        help="more options for llama-server, given with '=' since they begin with a dash: "
                             "--llama-server-args=--no-repack (default: none)")
    parser.add_argument("--phase-limit", type=float, default=600.0,
                        help="hard limit of each phase in seconds (and of a server's start, if over 300; default: 600)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure and setting to FILE")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here a 2-layer llama-tiny, 1 round, "
                        "1 and 2 streams of 8 tokens, atencion both ways (and llama.cpp where installed)")
    args = parser.parse_args(argv if argv is not None else None)
    if args.smoke:
        engines = ["atencion", "atencion-seq1"] + (["llama.cpp-f32"] if installed("llama_cpp", "llama.cpp") else [])
        main(["--preset", "llama-tiny", "--vocab", "512", "--layers", "2", "--rounds", "1", "--clients", "1,2",
              "--new-tokens", "8", "--threads", "1", "--phase-limit", "60", "--engines", ",".join(engines),
              *(["--json", args.json] if args.json else [])])
        return 0  # a tiny random model's figures are no result: the smoke run shows that every part runs
    try:
        args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--clients {args.clients}: expected counts separated by commas, e.g. 1,4,16,32")
    if not args.clients or min(args.clients) < 1:
        parser.error("--clients: give counts of at least 1")
    for name in ("rounds", "new_tokens", "prompt_tokens", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown {unknown}; choose among {', '.join(ENGINES)}")
    if "atencion-seq1" not in engines:
        engines.append("atencion-seq1")
    skipped = {}
    if args.llama_server is None:
        for e in [e for e in engines if e.startswith("llama-server")]:
            skipped[e] = "no llama-server binary (--llama-server PATH, $LLAMA_SERVER or llama-server on PATH)"
            engines.remove(e)
    if any(e.startswith("llama.cpp") for e in engines) and not installed("llama_cpp", "llama.cpp's rows"):
        for e in [e for e in engines if e.startswith("llama.cpp")]:
            skipped[e] = "llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')"
            engines.remove(e)
    engines = [e for e in ENGINES if e in engines]  # in a fixed order
    machine = cpu_info()
    args.llama_extra_bufts = {"on": True, "off": False}.get(args.llama_extra_bufts, not machine["amx"])

    report: dict = {"settings": {
        "preset": args.preset, "vocab": args.vocab, "layers": args.layers or None, "clients": args.clients,
        "rounds": args.rounds, "new_tokens": args.new_tokens, "prompt_tokens": args.prompt_tokens,
        "threads": args.threads, "engines": engines, "phase_limit_s": args.phase_limit, "temperature": 0,
        "python": platform.python_version(), "torch": version("torch"), "openai": version("openai"),
        "llama_cpp_python": version("llama_cpp_python"), "platform": platform.platform(), "argv": sys.argv[1:],
        "llama_extra_bufts": args.llama_extra_bufts}, "machine": machine, "skipped": skipped}
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that every server is stopped
    began = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="serve_llm_") as work:
            run(args, engines, Path(work), report)
    except KeyboardInterrupt:
        print("interrupted: every server it started is stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    report["total_s"] = time.perf_counter() - began
    print_report(report)
    print(f"({report['total_s']:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    failed = sum(r["errors"] for table in report["by_clients"].values() for e, r in table["engines"].items()
                 if e.startswith("atencion"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
