"""Load test of `atencion serve` on loopback: latency, throughput, dynamic batching, overload.

    python -m benchmarks.serve_load --model /tmp/demo2/run/best                 # a table (~2 minutes)
    python -m benchmarks.serve_load --model /tmp/demo2/run/best --quick         # ~1 minute on 2 cores
    python -m benchmarks.serve_load --smoke                                      # seconds: a check
    python -m benchmarks.serve_load --model DIR --clients 32 --requests 16 --repeats 5 --json out.json

The script starts the server itself (`python -m atencion serve`, on 127.0.0.1 and a free port, with
--threads of this script, default: the CPUs this process may use), waits for GET /health, and
always stops it at the end. It talks to nothing but 127.0.0.1, ignores proxy settings, and stops by
itself: every phase has a hard time limit (--phase-limit). The clients (asyncio + httpx) run in
this process, so on a small machine they share the CPUs with the server, as real local clients
would. Inputs are the held-out sentences of the demo grammar (`grammar.split(100, 500, seed=0)`,
what the demo model was trained against), or the lines of --inputs; request i carries the next
--sentences-per-request of them, cycling.

1. sequential: one client, one request at a time (--sequential-requests) → sentences/s and
   p50/p95/p99 latency; the server's batches are then 1 request each.
2. concurrent: --clients clients each send --requests requests back to back → sentences/s,
   p50/p95/p99, errors (any answer but 200; must be 0: the load is below every limit) and the mean
   batch size (sentences per decoding batch, from the atencion_batch_sentences histogram of
   GET /metrics, delta over the phase).
   Phases 1 and 2 alternate --repeats times after a warm-up; each round gives the ratio of
   concurrent to sequential sentences/s, and the report gives the median ratio and its min-max
   range (this machine's speed drifts, so a ratio is only compared within one round). Dynamic
   batching should give >= --min-ratio (3x) on the demo model. Latency percentiles pool the rounds.
   `agreement` is the share of sentences translated identically alone and inside a batch.
   `server ms` is the mean time a request spent inside the server (its atencion_request_seconds
   histogram); the rest of the client's latency is spent in the clients and on the way. `CPU srv/cli`
   is the CPU time of the server process and of this one over the phase's wall time (1.0 = a whole
   core): on a small machine the clients take their share, and a busy machine gives both less.
3. overload: the server is restarted with --max-queue --overload-queue (8) and
   --overload-clients (128) clients send requests for --overload-seconds; a refused client pauses
   --overload-pause seconds (less than Retry-After, to keep the queue full) and tries again. It
   counts the answers by status (429s must be > 0, each with a Retry-After header, no 5xx), the
   deepest queue seen in /metrics (must stay <= the limit), the latency of GET /health from a
   thread of its own (is the server's event loop still answering?), and the server's RSS (VmRSS of
   /proc/PID/status, sampled every 20 ms) before, at its peak (and in each half of the burst: a
   bounded server levels off) and after. Then recovery: the time until a normal request is answered
   200 again, and the latency of a few more lone requests against phase 1.

The exit status is 1 when a check fails (errors below the limits, ratio under --min-ratio, no 429,
a 429 without Retry-After, a 5xx, no recovery, RSS growth over --max-rss-growth-mib), else 0.
--json FILE writes every figure with the settings, to rerun and compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path

import httpx

from benchmarks.common import ROOT, SMOKE_HELP, free_port, smoke_dir, smoke_requested

KIND = "speed"  # a speed (and load) benchmark (benchmarks/__init__.py lists the two groups)
HOST = "127.0.0.1"  # loopback only, always


# inputs and small helpers ----------------------------------------------------------------------

def load_inputs(path: str | None) -> tuple[list[str], dict[str, str]]:
    """The sentences to send, and their references when known (demo grammar: source → target)."""
    if path:
        lines = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
        if not lines:
            sys.exit(f"--inputs {path}: no sentences")
        return lines, {}
    from atencion.demo import grammar

    _, test = grammar.split(100, 500, seed=0)
    return [p.src for p in test], {p.src: p.tgt for p in test}


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks; q in [0, 100]."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def latency_figures(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {"p50_ms": percentile(ms, 50), "p95_ms": percentile(ms, 95), "p99_ms": percentile(ms, 99),
            "max_ms": max(ms) if ms else None}


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process (VmRSS), in MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


_SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text → {(name, ((label, value), ...)): value}."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def statuses(samples: dict, endpoint: str = "/translate") -> dict[str, float]:
    return {dict(labels)["status"]: value for (name, labels), value in samples.items()
            if name == "atencion_requests_total" and dict(labels).get("endpoint") == endpoint}


# the server ------------------------------------------------------------------------------------

class Server:
    """`atencion serve` as a subprocess on 127.0.0.1; its log goes to a file (one line a request)."""

    def __init__(self, args, port: int, max_queue: int, log_dir: Path, name: str):
        self.port, self.max_queue = port, max_queue
        self.url = f"http://{HOST}:{port}"
        self.log_path = log_dir / f"{name}.log"
        self.command = [sys.executable, "-m", "atencion", "serve", "--model", args.model, "--host", HOST,
                        "--port", str(port), "--threads", str(args.threads), "--max-queue", str(max_queue),
                        "--batch-tokens", str(args.batch_tokens), "--max-wait-ms", str(args.max_wait_ms),
                        "--timeout", str(args.server_timeout)]
        self.proc: subprocess.Popen | None = None

    def start(self, limit: float) -> float:
        """Start and wait for /health; the seconds it took."""
        began = time.perf_counter()
        with open(self.log_path, "wb") as log:  # the server keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=ROOT)
        with httpx.Client(base_url=self.url, trust_env=False, timeout=2.0) as client:
            while time.perf_counter() - began < limit:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if client.get("/health").status_code == 200:
                        return time.perf_counter() - began
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        raise RuntimeError(f"the server did not answer /health within {limit:g} s:\n{self.log_tail()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss(self) -> float | None:
        return rss_mib(self.proc.pid) if self.proc else None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def internal_errors(self) -> int:
        """Lines of the log that report an internal error (a traceback on a 500)."""
        try:
            return sum("internal error" in line or line.startswith("Traceback")
                       for line in self.log_path.read_text(errors="replace").splitlines())
        except OSError:
            return 0

    def stop(self) -> None:
        """SIGTERM (requests in flight are answered), then SIGKILL after 10 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# load ------------------------------------------------------------------------------------------

class Load:
    """Sends requests from a shared cycle of inputs and records what came back."""

    def __init__(self, client: httpx.AsyncClient, inputs: list[str], per_request: int, beam: int):
        self.client, self.inputs, self.per_request, self.beam = client, inputs, per_request, beam
        self.cursor = 0

    def next_sentences(self) -> list[str]:
        n = len(self.inputs)
        out = [self.inputs[(self.cursor + j) % n] for j in range(self.per_request)]
        self.cursor = (self.cursor + self.per_request) % n
        return out

    async def post(self, sentences: list[str]) -> tuple[int | str, float, httpx.Response | None]:
        began = time.perf_counter()
        try:
            r = await self.client.post("/translate", json={"sentences": sentences, "beam": self.beam})
            return r.status_code, time.perf_counter() - began, r
        except httpx.HTTPError as err:  # timeouts and transport errors: counted, never raised
            return type(err).__name__, time.perf_counter() - began, None


class HealthProbe(threading.Thread):
    """GET /health every 0.1 s from a thread of its own, on its own connection: how long the
    server's event loop takes to answer while the load runs, apart from our clients' event loop."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.latencies, self.failures, self._halt = url, [], 0, threading.Event()

    def run(self):
        with httpx.Client(base_url=self.url, trust_env=False, timeout=30) as client:
            while not self._halt.is_set():
                began = time.perf_counter()
                try:
                    client.get("/health").raise_for_status()
                    self.latencies.append(time.perf_counter() - began)
                except httpx.HTTPError:
                    self.failures += 1
                self._halt.wait(0.1)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self._halt.set()
        self.join(35)


class RssSampler:
    """The server's RSS every 20 ms while a phase runs (reading /proc: no request)."""

    def __init__(self, pid: int):
        self.pid, self.samples, self._task = pid, [], None

    async def _run(self):
        while True:
            value = rss_mib(self.pid)
            if value is not None:
                self.samples.append((time.perf_counter(), value))
            await asyncio.sleep(0.02)

    def __enter__(self):
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc):
        self._task.cancel()

    @property
    def peak(self) -> float | None:
        return max((v for _, v in self.samples), default=None)


async def run_phase(load: Load, clients: int, requests: int, limit: float, seen: dict[str, str] | None = None):
    """``clients`` clients, each sending ``requests`` requests back to back, within ``limit`` s."""
    deadline = time.perf_counter() + limit
    latencies: list[float] = []
    errors: dict[str, int] = {}
    sentences = 0

    async def client():
        nonlocal sentences
        for _ in range(requests):
            if time.perf_counter() >= deadline:
                return
            batch = load.next_sentences()
            status, seconds, response = await load.post(batch)
            if status == 200:
                latencies.append(seconds)
                sentences += len(batch)
                if seen is not None:
                    for src, t in zip(batch, response.json()["translations"]):
                        seen.setdefault(src, t["text"])
            else:
                errors[str(status)] = errors.get(str(status), 0) + 1

    began = time.perf_counter()
    tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    _, pending = await asyncio.wait(tasks, timeout=limit + 5)
    for t in pending:
        t.cancel()
    wall = time.perf_counter() - began
    return {"requests_ok": len(latencies), "sentences": sentences, "wall_s": wall,
            "sentences_per_s": sentences / wall if wall > 0 else 0.0,
            "errors": sum(errors.values()) + len(pending),
            "error_kinds": errors | ({"cut": len(pending)} if pending else {}),
            "stopped_by_limit": time.perf_counter() >= deadline or bool(pending),
            "latencies": latencies}


class ServerSide:
    """Deltas over a phase of the server's own figures: /metrics, and its CPU time against ours."""

    def __init__(self, client: httpx.AsyncClient, pid: int):
        self.client, self.pid = client, pid

    async def _snapshot(self) -> dict:
        m = parse_metrics((await self.client.get("/metrics")).text)
        return {"batch_sum": metric(m, "atencion_batch_sentences_sum"),
                "batch_count": metric(m, "atencion_batch_sentences_count"),
                "seconds_sum": metric(m, "atencion_request_seconds_sum", endpoint="/translate"),
                "seconds_count": metric(m, "atencion_request_seconds_count", endpoint="/translate"),
                "server_cpu": cpu_seconds(self.pid) or 0.0, "client_cpu": time.process_time(),
                "wall": time.perf_counter()}

    async def __aenter__(self):
        self.start = await self._snapshot()
        return self

    async def __aexit__(self, *exc):
        end = await self._snapshot()
        d = {k: end[k] - self.start[k] for k in end}
        self.figures = {
            "mean_batch_sentences": d["batch_sum"] / d["batch_count"] if d["batch_count"] else None,
            "batches": int(d["batch_count"]),
            # inside the server, from the request's arrival to its answer (the client adds the rest)
            "server_mean_ms": 1000 * d["seconds_sum"] / d["seconds_count"] if d["seconds_count"] else None,
            "server_cpu_share": d["server_cpu"] / d["wall"] if d["wall"] > 0 else None,   # 1.0 = one core
            "client_cpu_share": d["client_cpu"] / d["wall"] if d["wall"] > 0 else None}


async def throughput(args, server: Server, inputs: list[str], references: dict[str, str]) -> dict:
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    timeout = httpx.Timeout(args.server_timeout + 10)
    async with httpx.AsyncClient(base_url=server.url, trust_env=False, limits=limits, timeout=timeout) as client:
        load = Load(client, inputs, args.sentences_per_request, args.beam)
        # warm-up: a few lone requests, then one concurrent burst (thread pools, allocator, JIT paths)
        await run_phase(load, 1, 4, args.phase_limit)
        await run_phase(load, args.clients, 1, args.phase_limit)
        rss_start = server.rss()
        alone: dict[str, str] = {}
        together: dict[str, str] = {}
        rounds = []
        seq_lat: list[float] = []
        conc_lat: list[float] = []
        with RssSampler(server.pid) as sampler:
            for r in range(args.repeats):
                row, start = {}, load.cursor
                for phase, clients, requests, seen in (("sequential", 1, args.sequential_requests, alone),
                                                       ("concurrent", args.clients, args.requests, together)):
                    load.cursor = start  # both phases of a round start on the same sentences
                    async with ServerSide(client, server.pid) as side:
                        result = await run_phase(load, clients, requests, args.phase_limit, seen)
                    result |= side.figures
                    (seq_lat if phase == "sequential" else conc_lat).extend(result.pop("latencies"))
                    row[phase] = result
                    print(f"  round {r + 1}/{args.repeats} {phase:<10} {result['sentences_per_s']:7.1f} sentences/s"
                          f"  errors {result['errors']}  mean batch {result['mean_batch_sentences'] or 0:.1f}"
                          f"  CPU server {result['server_cpu_share'] or 0:.2f} client {result['client_cpu_share']:.2f}",
                          file=sys.stderr, flush=True)
                seq, conc = row["sequential"]["sentences_per_s"], row["concurrent"]["sentences_per_s"]
                row["ratio"] = conc / seq if seq > 0 else None
                rounds.append(row)
        rss_end = server.rss()
        final = parse_metrics((await client.get("/metrics")).text)

    ratios = [r["ratio"] for r in rounds if r["ratio"] is not None]

    def summary(phase: str, latencies: list[float]) -> dict:
        rows = [r[phase] for r in rounds]
        batches = [x["mean_batch_sentences"] for x in rows if x["mean_batch_sentences"] is not None]

        def mean(key):
            values = [x[key] for x in rows if x[key] is not None]
            return statistics.mean(values) if values else None
        return {"sentences_per_s_median": statistics.median(x["sentences_per_s"] for x in rows),
                "sentences_per_s_min": min(x["sentences_per_s"] for x in rows),
                "sentences_per_s_max": max(x["sentences_per_s"] for x in rows),
                "requests_ok": sum(x["requests_ok"] for x in rows), "errors": sum(x["errors"] for x in rows),
                "stopped_by_limit": any(x["stopped_by_limit"] for x in rows),
                "mean_batch_sentences": statistics.mean(batches) if batches else None,
                **latency_figures(latencies), "server_mean_ms": mean("server_mean_ms"),
                "server_cpu_share": mean("server_cpu_share"), "client_cpu_share": mean("client_cpu_share")}

    common = sorted(set(alone) & set(together))
    exact = [alone[s] == references[s] for s in alone if s in references]
    return {"sequential": summary("sequential", seq_lat), "concurrent": summary("concurrent", conc_lat),
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None),
            "rounds": rounds,
            "agreement": sum(alone[s] == together[s] for s in common) / len(common) if common else None,
            "agreement_sentences": len(common),
            "exact_match_reference": sum(exact) / len(exact) if exact else None,
            "rss_mib": {"start": rss_start, "peak": sampler.peak, "end": rss_end},
            "server_statuses": statuses(final)}


async def overload(args, server: Server, inputs: list[str], baseline_p50_ms: float | None) -> dict:
    n = args.overload_clients
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    timeout = httpx.Timeout(args.server_timeout + 10)
    async with httpx.AsyncClient(base_url=server.url, trust_env=False, limits=limits, timeout=timeout) as client, \
            httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=10) as probe:
        load = Load(client, inputs, args.sentences_per_request, args.beam)
        await run_phase(load, 1, 4, args.phase_limit)  # warm-up
        await asyncio.sleep(0.5)
        rss_before = server.rss()
        before = parse_metrics((await probe.get("/metrics")).text)
        counts: dict[str, int] = {}
        latencies: list[float] = []
        refused: list[float] = []
        no_retry_after = bad_body = 0
        queue_depths: list[float] = []
        end = time.perf_counter() + args.overload_seconds

        async def client_loop():
            nonlocal no_retry_after, bad_body
            while time.perf_counter() < end:
                status, seconds, response = await load.post(load.next_sentences())
                counts[str(status)] = counts.get(str(status), 0) + 1
                if status == 200:
                    latencies.append(seconds)
                elif status == 429:
                    refused.append(seconds)
                    if not response.headers.get("retry-after"):
                        no_retry_after += 1
                    try:
                        bad_body += "error" not in response.json()
                    except ValueError:
                        bad_body += 1
                    await asyncio.sleep(args.overload_pause)
                else:
                    await asyncio.sleep(args.overload_pause)

        async def watch_queue():
            while time.perf_counter() < end:
                try:
                    samples = parse_metrics((await probe.get("/metrics")).text)
                    queue_depths.append(max((v for (name, _), v in samples.items()
                                             if name == "atencion_queue_depth"), default=0.0))
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)

        began = time.perf_counter()
        with RssSampler(server.pid) as sampler, HealthProbe(server.url) as health:
            async with ServerSide(probe, server.pid) as side:
                tasks = [asyncio.ensure_future(client_loop()) for _ in range(n)]
                tasks.append(asyncio.ensure_future(watch_queue()))
                _, pending = await asyncio.wait(tasks, timeout=args.overload_seconds + args.server_timeout + 10)
                for t in pending:
                    t.cancel()
            burst_s = time.perf_counter() - began  # the burst, then the requests it left in flight
            # recovery: the first 200 after the burst, then a few lone requests
            recovered_after = None
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.phase_limit:
                status, _, response = await load.post(load.next_sentences())
                if status == 200:
                    recovered_after = time.perf_counter() - t0
                    break
                await asyncio.sleep(float(response.headers.get("retry-after", 0.2)) if response is not None else 0.2)
            after = await run_phase(load, 1, 8, args.phase_limit) if recovered_after is not None else None
        await asyncio.sleep(0.5)
        rss_after = server.rss()
        final = parse_metrics((await probe.get("/metrics")).text)

    samples = sampler.samples
    half = began + burst_s / 2
    server_counts = {k: v - statuses(before).get(k, 0.0) for k, v in statuses(final).items()}
    return {"clients": n, "max_queue": server.max_queue, "burst_s": args.overload_seconds, "seconds": burst_s,
            "pause_s": args.overload_pause,
            "statuses": counts, "requests": sum(counts.values()), "status_429": counts.get("429", 0),
            "status_200": counts.get("200", 0),
            "status_5xx": sum(v for k, v in counts.items() if k.isdigit() and int(k) >= 500),
            "other_errors": {k: v for k, v in counts.items() if k not in ("200", "429")},
            "missing_retry_after": no_retry_after, "non_json_429": bad_body,
            "server_statuses": server_counts, "cut": len(pending),
            "ok_latency": latency_figures(latencies), "refused_latency": latency_figures(refused), **side.figures,
            "health_latency": latency_figures(health.latencies), "health_failures": health.failures,
            "queue_depth_max": max(queue_depths, default=None), "queue_samples": len(queue_depths),
            "rss_mib": {"before": rss_before, "peak": sampler.peak,
                        "peak_first_half": max((v for t, v in samples if t < half), default=None),
                        "peak_second_half": max((v for t, v in samples if t >= half), default=None),
                        "after": rss_after},
            "rss_growth_peak_mib": (sampler.peak - rss_before) if sampler.peak and rss_before else None,
            "rss_growth_after_mib": (rss_after - rss_before) if rss_after and rss_before else None,
            "recovered": recovered_after is not None, "recovered_after_s": recovered_after,
            "after_errors": after["errors"] if after else None,
            "after_p50_ms": latency_figures(after["latencies"])["p50_ms"] if after else None,
            "baseline_p50_ms": baseline_p50_ms,
            "internal_errors_logged": server.internal_errors()}


# report ----------------------------------------------------------------------------------------

def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(report: dict) -> None:
    s = report["settings"]
    print(f"atencion serve load test: {s['model']} | {s['cpus']} CPUs, server threads {s['threads']} | "
          f"beam {s['beam']}, {s['sentences_per_request']} sentence(s)/request | {s['clients']} clients x "
          f"{s['requests']} requests, sequential {s['sequential_requests']}, {s['repeats']} rounds")
    t = report.get("throughput")
    if t:
        print(f"\n{'phase':<12}{'requests':>9}{'sent/s':>9}{'(min-max)':>16}{'p50 ms':>9}{'p95 ms':>9}"
              f"{'p99 ms':>9}{'errors':>8}{'batch':>7}{'server ms':>11}{'CPU srv/cli':>13}")
        for phase in ("sequential", "concurrent"):
            p = t[phase]
            span = f"{fmt(p['sentences_per_s_min'])}-{fmt(p['sentences_per_s_max'])}"
            print(f"{phase:<12}{p['requests_ok']:>9}{fmt(p['sentences_per_s_median']):>9}{span:>16}"
                  f"{fmt(p['p50_ms']):>9}{fmt(p['p95_ms']):>9}{fmt(p['p99_ms']):>9}{p['errors']:>8}"
                  f"{fmt(p['mean_batch_sentences']):>7}{fmt(p['server_mean_ms']):>11}"
                  f"{fmt(p['server_cpu_share'], 2) + '/' + fmt(p['client_cpu_share'], 2):>13}")
        print(f"\nconcurrent / sequential: {fmt(t['ratio_median'], 2)}x median of {len(t['rounds'])} rounds "
              f"(range {fmt(t['ratio_min'], 2)}-{fmt(t['ratio_max'], 2)}; target >= {s['min_ratio']:g}x)")
        print(f"agreement alone vs batched: {fmt(t['agreement'], 3)} over {t['agreement_sentences']} sentences; "
              f"exact match with the reference: {fmt(t['exact_match_reference'], 3)}")
        r = t["rss_mib"]
        print(f"server RSS (MiB): start {fmt(r['start'])}, peak {fmt(r['peak'])}, end {fmt(r['end'])}")
    o = report.get("overload")
    if o:
        r = o["rss_mib"]
        print(f"\noverload: {o['clients']} clients for {o['burst_s']:g} s (last answer at {o['seconds']:.1f} s), "
              f"--max-queue {o['max_queue']}: {o['requests']} requests, {o['status_200']} x 200, "
              f"{o['status_429']} x 429, other {o['other_errors'] or 0}")
        print(f"  429 without Retry-After: {o['missing_retry_after']}; deepest queue seen: "
              f"{fmt(o['queue_depth_max'], 0)} ({o['queue_samples']} samples); 200 latency p50/p99 "
              f"{fmt(o['ok_latency']['p50_ms'])}/{fmt(o['ok_latency']['p99_ms'])} ms")
        print(f"  429 latency p50/p99 {fmt(o['refused_latency']['p50_ms'])}/{fmt(o['refused_latency']['p99_ms'])} ms;"
              f" GET /health from another thread p50/max {fmt(o['health_latency']['p50_ms'])}/"
              f"{fmt(o['health_latency']['max_ms'])} ms, failures {o['health_failures']}")
        print(f"  mean batch {fmt(o['mean_batch_sentences'])} sentences; mean time inside the server "
              f"{fmt(o['server_mean_ms'])} ms (all answers); CPU server {fmt(o['server_cpu_share'], 2)}, "
              f"clients {fmt(o['client_cpu_share'], 2)} cores")
        print(f"  server RSS (MiB): before {fmt(r['before'])}, peak {fmt(r['peak'])} (first half "
              f"{fmt(r['peak_first_half'])}, second half {fmt(r['peak_second_half'])}), after {fmt(r['after'])}; "
              f"growth at peak {fmt(o['rss_growth_peak_mib'])}, after {fmt(o['rss_growth_after_mib'])}")
        print(f"  recovery: {'200 after ' + fmt(o['recovered_after_s'], 2) + ' s' if o['recovered'] else 'NONE'}; "
              f"then p50 {fmt(o['after_p50_ms'])} ms (sequential p50 {fmt(o['baseline_p50_ms'])} ms), "
              f"errors {o['after_errors']}; internal errors logged: {o['internal_errors_logged']}")
    failed = [k for k, v in report["checks"].items() if not v]
    print(f"\nchecks: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)} "
          f"({', '.join(report['checks'])})")


def checks(report: dict, args) -> dict[str, bool]:
    out = {}
    t = report.get("throughput")
    if t:
        out["no_errors_below_limits"] = t["sequential"]["errors"] == 0 and t["concurrent"]["errors"] == 0
        out["within_time_limits"] = not (t["sequential"]["stopped_by_limit"] or t["concurrent"]["stopped_by_limit"])
        out[f"ratio_at_least_{args.min_ratio:g}x"] = (t["ratio_median"] or 0) >= args.min_ratio
    o = report.get("overload")
    if o:
        out["overload_429s"] = o["status_429"] > 0
        out["retry_after_on_every_429"] = o["missing_retry_after"] == 0 and o["non_json_429"] == 0
        out["no_5xx_under_overload"] = o["status_5xx"] == 0 and o["internal_errors_logged"] == 0
        out["queue_bounded"] = o["queue_depth_max"] is None or o["queue_depth_max"] <= o["max_queue"]
        out["rss_bounded"] = (o["rss_growth_peak_mib"] or 0) <= args.max_rss_growth_mib
        out["recovers"] = o["recovered"] and o["after_errors"] == 0
    return out


# main ------------------------------------------------------------------------------------------

def smoke_model(path: Path) -> Path:
    """A random translation model (1 + 1 layers, d_model 16) with a character vocabulary of the demo
    grammar's sentences, saved as a model directory: what the smoke run serves."""
    import torch

    from atencion import ModelConfig, Transformer
    from atencion.data.tokenizer import Tokenizer
    from atencion.nn.model_dir import save_model_dir

    sources, references = load_inputs(None)
    tokenizer = Tokenizer.train_text(sources + list(references.values()), kind="char")
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, n_layers=1, d_model=16, n_heads=2, d_ff=32, dropout=0.0)
    torch.manual_seed(0)
    save_model_dir(path, Transformer(cfg).eval(), tokenizer)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=not smoke_requested(argv),
                        help="the model directory to serve (e.g. /tmp/demo2/run/best)")
    parser.add_argument("--inputs", help="a text file, one source sentence a line (default: the demo grammar's "
                                         "500 held-out sentences)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients in phase 2 (default: 32)")
    parser.add_argument("--requests", type=int, default=0, help="requests per client per round in phase 2 "
                                                                "(default: 16, 4 with --quick)")
    parser.add_argument("--sequential-requests", type=int, default=0,
                        help="requests per round in phase 1 (default: 64, 20 with --quick)")
    parser.add_argument("--sentences-per-request", type=int, default=1)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=0,
                        help="rounds of phase 1 then phase 2 (default: 5, 3 with --quick)")
    parser.add_argument("--threads", type=int, default=cpu_count(),
                        help=f"the server's --threads (default: the CPU count, {cpu_count()} here)")
    parser.add_argument("--port", type=int, default=0, help="the server's port (default 0: a free one)")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="the server's --batch-tokens (default: 4096)")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="the server's --max-wait-ms (default: 5)")
    parser.add_argument("--server-timeout", type=float, default=60.0, help="the server's --timeout (default: 60)")
    parser.add_argument("--overload-queue", type=int, default=8, help="--max-queue in phase 3 (default: 8)")
    parser.add_argument("--overload-clients", type=int, default=128, help="clients in phase 3 (default: 128)")
    parser.add_argument("--overload-seconds", type=float, default=0.0,
                        help="length of the burst (default: 15, 5 with --quick)")
    parser.add_argument("--overload-pause", type=float, default=0.05,
                        help="seconds a refused client waits before its next request (default: 0.05)")
    parser.add_argument("--skip-overload", action="store_true", help="phases 1 and 2 only")
    parser.add_argument("--skip-throughput", action="store_true", help="phase 3 only")
    parser.add_argument("--phase-limit", type=float, default=0.0,
                        help="hard limit per phase in seconds (default: 120, 30 with --quick)")
    parser.add_argument("--min-ratio", type=float, default=3.0, help="the throughput ratio to reach (default: 3)")
    parser.add_argument("--max-rss-growth-mib", type=float, default=256.0,
                        help="RSS growth allowed under overload (default: 256 MiB)")
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds (about a minute)")
    parser.add_argument("--json", metavar="FILE", help="also write every figure to FILE")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here a random 1+1-layer model, a few "
                        "requests, a one-second burst; its checks are printed, not its exit status")
    args = parser.parse_args(argv)
    if args.smoke:
        with smoke_dir("serve_load") as tmp:
            main(["--model", str(args.model or smoke_model(tmp / "model")), "--clients", "2", "--requests", "1",
                  "--sequential-requests", "2", "--repeats", "1", "--threads", "1", "--beam", "1",
                  "--overload-clients", "8", "--overload-queue", "1", "--overload-seconds", "1",
                  "--phase-limit", "30", "--min-ratio", "0", "--server-timeout", "10"])
        return 0  # a tiny random model's verdicts are no result: the smoke run shows that every phase runs
    args.requests = args.requests or (4 if args.quick else 16)
    args.sequential_requests = args.sequential_requests or (20 if args.quick else 64)
    args.repeats = args.repeats or (3 if args.quick else 5)
    args.overload_seconds = args.overload_seconds or (5.0 if args.quick else 15.0)
    args.phase_limit = args.phase_limit or (30.0 if args.quick else 120.0)
    for name in ("clients", "requests", "sequential_requests", "sentences_per_request", "repeats", "threads",
                 "overload_queue", "overload_clients"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: not a model directory (no config.json)")
    args.model = str(Path(args.model).resolve())

    inputs, references = load_inputs(args.inputs)
    report: dict = {"settings": {
        "model": args.model, "inputs": args.inputs or "demo grammar split(100, 500, seed=0) test",
        "clients": args.clients, "requests": args.requests, "sequential_requests": args.sequential_requests,
        "sentences_per_request": args.sentences_per_request, "beam": args.beam, "repeats": args.repeats,
        "threads": args.threads, "cpus": cpu_count(), "batch_tokens": args.batch_tokens,
        "max_wait_ms": args.max_wait_ms, "server_timeout": args.server_timeout,
        "overload_queue": args.overload_queue, "overload_clients": args.overload_clients,
        "overload_seconds": args.overload_seconds, "overload_pause": args.overload_pause,
        "phase_limit": args.phase_limit, "min_ratio": args.min_ratio, "quick": args.quick,
        "python": platform.python_version(), "torch": _version("torch"), "httpx": _version("httpx"),
        "uvicorn": _version("uvicorn"), "platform": platform.platform(), "argv": sys.argv[1:]}}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` stops the server
    began = time.perf_counter()
    port = args.port or free_port()
    with tempfile.TemporaryDirectory(prefix="serve_load_") as logs:
        if not args.skip_throughput:
            server = Server(args, port, 256, Path(logs), "throughput")
            try:
                report["startup_s"] = server.start(args.phase_limit)
                print(f"server up on {server.url} (pid {server.pid}) in {report['startup_s']:.1f} s", file=sys.stderr)
                report["throughput"] = asyncio.run(throughput(args, server, inputs, references))
                report["throughput"]["internal_errors_logged"] = server.internal_errors()
            finally:
                server.stop()
        if not args.skip_overload:
            baseline = report.get("throughput", {}).get("sequential", {}).get("p50_ms")
            server = Server(args, port, args.overload_queue, Path(logs), "overload")
            try:
                server.start(args.phase_limit)
                print(f"overload server up on {server.url} (pid {server.pid}, --max-queue {args.overload_queue})",
                      file=sys.stderr)
                report["overload"] = asyncio.run(overload(args, server, inputs, baseline))
            finally:
                server.stop()
    report["total_s"] = time.perf_counter() - began
    report["checks"] = checks(report, args)
    print_report(report)
    print(f"({report['total_s']:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if all(report["checks"].values()) else 1


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
