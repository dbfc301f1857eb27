"""The server's figures in Prometheus text format (prometheus_client, one registry per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series: a rate needs none


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter("atencion_requests", "HTTP requests by endpoint and status",
                                 ["endpoint", "status"], registry=r)
        self._latency = Histogram("atencion_request_seconds", "time to answer a request", ["endpoint"],
                                  buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                  registry=r)
        self._sentences = Counter("atencion_sentences", "sentences translated", registry=r)
        self._tokens = Counter("atencion_tokens", "subword tokens translated (with </s>)", ["side"], registry=r)
        self._in_flight = Gauge("atencion_requests_in_flight", "HTTP requests received and not yet answered",
                                ["endpoint"], registry=r)
        self._queue = Gauge("atencion_queue_depth", "requests waiting for a batch", ["model"], registry=r)
        self._batch = Histogram("atencion_batch_sentences", "sentences decoded together",
                                buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r)
        self._batch_tokens = Histogram("atencion_batch_tokens", "source tokens decoded together",
                                       buckets=(16, 64, 256, 1024, 2048, 4096, 8192, 16384), registry=r)

    def in_flight(self, endpoint: str):
        """A context manager: a request to ``endpoint`` is in flight inside it."""
        return self._in_flight.labels(endpoint).track_inprogress()

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        self._requests.labels(endpoint, str(status)).inc()
        self._latency.labels(endpoint).observe(seconds)

    def sentences(self, n: int, source_tokens: int, target_tokens: int) -> None:
        self._sentences.inc(n)
        self._tokens.labels("source").inc(source_tokens)
        self._tokens.labels("target").inc(target_tokens)

    def batch(self, sentences: int, tokens: int) -> None:
        self._batch.observe(sentences)
        self._batch_tokens.observe(tokens)

    def queue_depth(self, model: str, depth: int) -> None:
        self._queue.labels(model).set(depth)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
