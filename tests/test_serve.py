"""`atencion serve` through HTTP, against a server the test starts on a free loopback port:
answers, dynamic batching, limits, every bad request a 4xx naming what was wrong, the key,
metrics, and a graceful stop."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from atencion.decode.translate import translate_lines
from atencion.nn.model_dir import load_model_dir
from atencion.serve.app import LoadedModel, ServeSettings, create_app
from atencion.serve.run import uvicorn_config

SENTENCES = ["el gato negro come el ratón", "el banco aprobó el crédito", "las casas blancas eran viejas",
             "el hombre se sentó en el banco"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running(model_dir, **settings):
    """A server on a free loopback port, in a thread of this process, configured as `atencion
    serve` configures uvicorn; yields its base URL."""
    model, tokenizer = load_model_dir(model_dir)
    limits = ServeSettings(**settings)
    app = create_app([LoadedModel("demo", str(model_dir), model, tokenizer)], limits)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, limits))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def url(demo_model_dir):
    with running(demo_model_dir) as base:
        yield base


@pytest.fixture(scope="module")
def reference(demo_model_dir):
    """Each sentence translated alone (beam 4) by the library, to compare answers with."""
    model, tokenizer = load_model_dir(demo_model_dir)
    return {s: translate_lines(model, tokenizer, [s], beam=4, nbest=2)[0] for s in SENTENCES}


def test_translate_answers_what_the_library_computes(url, reference):
    r = httpx.post(f"{url}/translate", json={"sentences": SENTENCES, "nbest": 2})
    assert r.status_code == 200, r.text
    out = r.json()["translations"]
    assert [t["text"] for t in out] == [reference[s][0].text for s in SENTENCES]
    assert out[0]["text"] == "the black cat eats the mouse"
    for t, s in zip(out, SENTENCES):
        assert [h["text"] for h in t["nbest"]] == [h.text for h in reference[s]]
        assert t["score"] == pytest.approx(reference[s][0].score, abs=1e-4)


def test_concurrent_requests_are_decoded_together_and_get_the_answers_they_would_alone(demo_model_dir, reference):
    with running(demo_model_dir, max_wait_ms=200) as base:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda i: httpx.post(f"{base}/translate", timeout=60,
                                                         json={"sentences": [SENTENCES[i % 4]]}), range(16)))
        assert [a.status_code for a in answers] == [200] * 16
        assert [a.json()["translations"][0]["text"] for a in answers] == \
            [reference[SENTENCES[i % 4]][0].text for i in range(16)]
        metrics = httpx.get(f"{base}/metrics").text
    count = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("atencion_batch_sentences_count")))
    total = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("atencion_batch_sentences_sum")))
    assert total == 16 and count < 16, metrics  # fewer batches than requests: some were shared


def test_attention_comes_back_in_the_bertviz_layout_with_words_and_alignment(url):
    r = httpx.post(f"{url}/translate", json={"sentences": [SENTENCES[0]], "attention": True}).json()
    attention = r["translations"][0]["attention"]
    bertviz = attention["bertviz"]
    assert set(bertviz) == {"encoder_attention", "decoder_attention", "cross_attention", "encoder_tokens",
                            "decoder_tokens"}
    layers = len(bertviz["cross_attention"])
    heads = len(bertviz["cross_attention"][0][0])
    assert len(bertviz["cross_attention"][0][0][0][0]) == len(bertviz["encoder_tokens"])
    for unit in ("pieces", "words"):
        cross = attention[unit]["cross"]
        assert len(cross["weights"]) == layers and len(cross["weights"][0]) == heads
        for row in cross["weights"][0][0]:
            assert sum(row) == pytest.approx(1.0, abs=1e-3)
    words = attention["words"]["cross"]
    aligned = {(words["cols"][i], words["rows"][j]) for i, j in attention["alignment"]}
    assert ("negro", "black") in aligned and ("gato", "cat") in aligned


BAD = [
    ("not json", b"{sentences: [", 422, "not valid JSON"),
    ("not utf-8", b'{"sentences": ["el gato \xe9"]}', 422, "not UTF-8"),
    ("nested too deep", b"[" * 100_000, 422, "nested too deeply"),
    ("a list, not an object", b'[["el gato"]]', 422, "body"),
    ("no sentences", b"{}", 422, "sentences: required field missing"),
    ("sentences not a list", b'{"sentences": "el gato"}', 422, "sentences"),
    ("nested sentences", b'{"sentences": [["el gato"]]}', 422, "sentences.0"),
    ("empty list", b'{"sentences": []}', 422, "sentences"),
    ("an empty sentence", b'{"sentences": ["  "]}', 422, "sentences.0: the sentence is empty"),
    ("100k characters", json.dumps({"sentences": ["gato " * 20_000]}).encode(), 422, "sentences.0"),
    ("negative beam", b'{"sentences": ["el gato"], "beam": -3}', 422, "beam"),
    ("huge beam", b'{"sentences": ["el gato"], "beam": 100000}', 422, "beam"),
    ("beam as a string", b'{"sentences": ["el gato"], "beam": "4"}', 422, "beam"),
    ("nbest over beam", b'{"sentences": ["el gato"], "beam": 2, "nbest": 3}', 422, "nbest"),
    ("an unknown field", b'{"sentences": ["el gato"], "temperature": 1}', 422, "temperature: unknown field"),
    ("an unknown model", b'{"sentences": ["el gato"], "model": "nope"}', 404, "no model named 'nope'"),
    ("too many sentences", json.dumps({"sentences": ["el gato"] * 65}).encode(), 422, "limit of 64"),
]


@pytest.mark.parametrize("name, body, status, message", BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_is_a_4xx_naming_what_is_wrong_and_the_server_keeps_serving(url, name, body, status,
                                                                                  message):
    r = httpx.post(f"{url}/translate", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert message in r.json()["error"]
    assert "Traceback" not in r.text
    good = httpx.post(f"{url}/translate", json={"sentences": [SENTENCES[0]], "beam": 1})
    assert good.status_code == 200


def test_endpoints_of_other_model_kinds_answer_400_saying_why(url):
    for endpoint in ("generate", "fill-mask", "classify"):
        r = httpx.post(f"{url}/{endpoint}", json={"prompt": "el"})
        assert r.status_code == 400 and "encoder-decoder" in r.json()["error"], r.text
    assert httpx.get(f"{url}/nowhere").status_code == 404


def test_info_describes_the_model_and_the_page_is_served_with_its_own_files(url):
    info = httpx.get(f"{url}/info").json()
    model = info["models"][0]
    assert model["arch"] == "encoder-decoder" and model["endpoints"] == ["/translate"]
    assert model["decoding"]["beam"] == 4 and model["vocab_size"]["source"] == model["config"]["vocab_size"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    for name in ("explorer.js", "explorer.css"):
        assert httpx.get(f"{url}/static/{name}").status_code == 200
    assert "http://" not in page.text.replace(url, "") and "https://" not in page.text  # no CDN


def test_metrics_count_requests_by_endpoint_and_status(url):
    httpx.post(f"{url}/translate", json={"sentences": []})
    text = httpx.get(f"{url}/metrics").text
    assert 'atencion_requests_total{endpoint="/translate",status="422"}' in text
    assert 'atencion_requests_in_flight{endpoint="/metrics"} 1.0' in text  # itself, while it answers
    for name in ("atencion_request_seconds_bucket", "atencion_sentences_total", "atencion_tokens_total",
                 "atencion_queue_depth", "atencion_batch_sentences_bucket"):
        assert name in text


def test_a_body_over_the_limit_is_413(demo_model_dir):
    with running(demo_model_dir, max_body_bytes=200) as base:
        r = httpx.post(f"{base}/translate", json={"sentences": ["el gato negro"] * 20})
        assert r.status_code == 413 and "larger than 200 bytes" in r.json()["error"]

        def chunks():
            yield b'{"sentences": ['
            for _ in range(30):
                yield b'"el gato negro",'
            yield b'"el"]}'
        r = httpx.post(f"{base}/translate", content=chunks())  # chunked: no Content-Length
        assert r.status_code == 413
        assert httpx.post(f"{base}/translate", json={"sentences": ["el gato"]}).status_code == 200


def test_a_full_queue_answers_429_with_retry_after_and_recovers(demo_model_dir):
    with running(demo_model_dir, max_queue=1, max_wait_ms=0) as base:
        body = {"sentences": SENTENCES * 8, "beam": 8}
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{base}/translate", json=body, timeout=120), range(12)))
        statuses = [a.status_code for a in answers]
        assert 429 in statuses and 200 in statuses and set(statuses) <= {200, 429}, statuses
        assert all(a.headers.get("retry-after") == "1" for a in answers if a.status_code == 429)
        assert httpx.post(f"{base}/translate", json={"sentences": ["el gato"]}).status_code == 200


def test_a_request_over_its_time_is_504(demo_model_dir):
    with running(demo_model_dir, timeout_s=0.001) as base:
        r = httpx.post(f"{base}/translate", json={"sentences": SENTENCES * 8})
        assert r.status_code == 504 and "no answer within" in r.json()["error"]


def test_an_api_key_guards_every_endpoint_but_health(demo_model_dir):
    with running(demo_model_dir, api_key="s3cret") as base:
        assert httpx.get(f"{base}/health").status_code == 200
        for method, path in (("GET", "/info"), ("GET", "/metrics"), ("GET", "/"), ("POST", "/translate")):
            r = httpx.request(method, f"{base}{path}", json={"sentences": ["el gato"]})
            assert r.status_code == 401 and "API key" in r.json()["error"], path
        ok = httpx.post(f"{base}/translate", json={"sentences": ["el gato"]}, headers={"X-API-Key": "s3cret"})
        assert ok.status_code == 200
        assert httpx.get(f"{base}/info", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{base}/info?key=wrong").status_code == 401


def test_sigterm_stops_the_server_after_the_request_in_flight(demo_model_dir, tmp_path):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "atencion", "serve", "--model", f"demo={demo_model_dir}",
                                "--port", str(port)], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, f"{base}/translate", json={"sentences": SENTENCES * 16, "beam": 8},
                               timeout=120)
            deadline = time.time() + 60
            while 'atencion_requests_in_flight{endpoint="/translate"} 1.0' not in httpx.get(f"{base}/metrics").text:
                assert not slow.done(), "the request was answered (or failed) before it was seen in flight"
                assert time.time() < deadline, "the request never showed in flight in /metrics"
                time.sleep(0.01)
            process.send_signal(signal.SIGTERM)  # the server has the request and has not answered it
            answer = slow.result()
        assert answer.status_code == 200 and len(answer.json()["translations"]) == 64
        assert process.wait(60) == -signal.SIGTERM  # it ends by the signal, as uvicorn does, once idle
        log = process.stderr.read()
        assert '"path": "/translate", "status": 200' in log  # one structured line per request
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)


def test_serve_refuses_a_bad_model_argument_in_one_line(tmp_path, capsys):
    from atencion.cli import main

    assert main(["serve", "--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model" in err[0]


def test_a_new_endpoint_is_one_table_entry_served_counted_described_and_refused_to_models_without_it(
        demo_model_dir, monkeypatch):
    """The seam of serve/app.py: an Endpoint added to the table (``model_endpoints``), and nothing else, is a POST
    route that validates its schema, counted by name in /metrics, listed in /info's endpoints with
    its info, and refused (400, before its fields are judged) to a model without its capability;
    /info's "decoding" is the first endpoint's defaults in the table."""
    from dataclasses import replace

    from fastapi.testclient import TestClient
    from pydantic import BaseModel, ConfigDict

    from atencion.serve import app as served

    class EchoRequest(BaseModel):
        model_config = ConfigDict(extra="forbid", strict=True)
        text: str
        model: str | None = None
        times: int = 2

    async def echo(body, m, ctx):
        return {"model": m.name, "echo": body.text * body.times, "limit": ctx.settings.max_tokens}

    translate = next(e for e in served.model_endpoints() if e.name == "translate")
    table = (replace(translate, defaults=("beam",), server_defaults=lambda s: {"max_len_b": s.max_tokens}),
             *(e for e in served.model_endpoints() if e.name != "translate"),
             served.Endpoint("echo", EchoRequest, "any model", lambda m: True, echo, defaults=("times",),
                             info=lambda m: {"echoes": m.name}),
             served.Endpoint("never", EchoRequest, "a model that does not exist", lambda m: False, echo))
    monkeypatch.setattr(served, "model_endpoints", lambda: table)
    model, tokenizer = load_model_dir(demo_model_dir)
    app = create_app([LoadedModel("demo", str(demo_model_dir), model, tokenizer)], ServeSettings(max_tokens=99))
    posted = {r.path for r in app.routes if "POST" in getattr(r, "methods", ()) and not r.path.startswith("/v1/")}
    assert posted == {"/" + e.name for e in table}  # (the OpenAI protocol's routes besides: serve/openai.py)
    with TestClient(app) as client:
        r = client.post("/echo", json={"text": "ab", "times": 3})
        assert r.status_code == 200 and r.json() == {"model": "demo", "echo": "ababab", "limit": 99}, r.text
        r = client.post("/echo", json={"text": "ab", "times": "3"})
        assert r.status_code == 422 and r.json()["error"].startswith("times: "), r.text
        r = client.post("/never", json={"times": "not even valid"})
        assert r.status_code == 400 and r.json()["error"] == (
            "/never needs a model that does not exist; model 'demo' is a translator (arch encoder-decoder) and "
            "answers /translate, /echo"), r.text
        described = client.get("/info").json()["models"][0]
        assert described["endpoints"] == ["/translate", "/echo"] and described["echoes"] == "demo"
        assert described["decoding"] == {"beam": 4, "max_len_b": 99}
        metrics = client.get("/metrics").text
    for path, status in (("/echo", 200), ("/echo", 422), ("/never", 400)):
        assert f'atencion_requests_total{{endpoint="{path}",status="{status}"}} 1.0' in metrics, metrics


@pytest.mark.parametrize("arch, num_labels, mask_id, endpoints", [
    ("encoder-decoder", 0, None, ["translate"]), ("rnn", 0, None, ["translate"]),
    ("encoder-decoder", 2, 5, ["translate"]),  # a translator translates, whatever head it carries
    ("decoder", 0, None, ["generate", "attention"]), ("decoder", 2, None, ["classify", "generate", "attention"]),
    ("encoder", 0, 5, ["fill-mask", "attention"]), ("encoder", 0, None, ["attention"]),
    ("encoder", 2, 5, ["classify", "fill-mask", "attention"])])
def test_a_model_answers_the_table_s_endpoints_it_is_capable_of_its_own_task_s_first(arch, num_labels, mask_id,
                                                                                      endpoints):
    from types import SimpleNamespace

    from atencion.config import ModelConfig

    cfg = ModelConfig(vocab_size=30, arch=arch, num_labels=num_labels)
    assert LoadedModel("m", "", SimpleNamespace(cfg=cfg), SimpleNamespace(mask_id=mask_id)).endpoints == endpoints


def test_an_internal_error_is_a_500_counted_in_metrics_and_logged_as_one_json_line(demo_model_dir, monkeypatch,
                                                                                   caplog):
    """A bug in a handler (here a RuntimeError) is answered 500 with a JSON error, and, like every
    other response, counted in /metrics by endpoint and status and logged as one JSON line."""
    import logging
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from atencion.serve import app as served

    async def broken(body, m, ctx):
        raise RuntimeError("a bug in the handler")

    table = tuple(replace(e, handler=broken) if e.name == "translate" else e for e in served.model_endpoints())
    monkeypatch.setattr(served, "model_endpoints", lambda: table)
    monkeypatch.setattr(logging.getLogger("atencion.serve"), "propagate", True)  # run.serve turns it off
    caplog.set_level(logging.INFO, logger="atencion.serve")
    model, tokenizer = load_model_dir(demo_model_dir)
    app = create_app([LoadedModel("demo", str(demo_model_dir), model, tokenizer)])
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/translate", json={"sentences": ["el gato"]})
        assert r.status_code == 500 and r.json() == {"error": "internal error (RuntimeError); the server keeps "
                                                              "serving"}, r.text
        assert client.get("/health").status_code == 200
        metrics = client.get("/metrics").text
    assert 'atencion_requests_total{endpoint="/translate",status="500"} 1.0' in metrics, metrics
    assert 'atencion_request_seconds_count{endpoint="/translate"} 1.0' in metrics, metrics
    lines = [json.loads(record.getMessage()) for record in caplog.records
             if record.name == "atencion.serve" and record.getMessage().startswith("{")]
    assert [(line["method"], line["path"], line["status"]) for line in lines] == [
        ("POST", "/translate", 500), ("GET", "/health", 200), ("GET", "/metrics", 200)], lines
    assert any("a bug in the handler" in record.getMessage() for record in caplog.records
               if record.levelname == "ERROR")  # the traceback, for whoever mends it


def read_until_closed(connection: socket.socket, timeout: float) -> tuple[bytes, float]:
    """What the server sends on ``connection`` until it closes it, and the seconds that took
    (the test fails if it is still open after ``timeout``)."""
    began, data = time.monotonic(), b""
    connection.settimeout(timeout)
    while chunk := connection.recv(65536):
        data += chunk
    return data, time.monotonic() - began


def test_a_client_that_stalls_in_its_body_is_answered_408_within_the_read_timeout_and_others_are_served(
        demo_model_dir):
    with running(demo_model_dir, read_timeout_s=1) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as stalled:
            stalled.sendall(b'POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n'
                            b'Content-Length: 100\r\n\r\n{"sentences": ["el gato')  # 75 bytes short, for ever
            began = time.monotonic()
            good = httpx.post(f"{base}/translate", json={"sentences": [SENTENCES[0]], "beam": 1})
            assert good.status_code == 200 and good.json()["translations"][0]["text"] == "the black cat eats the mouse"
            answer, _ = read_until_closed(stalled, 10)
            waited = time.monotonic() - began
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), answer
        assert json.loads(body) == {"error": "the request body did not arrive within 1 s; the connection is "
                                             "closed"}, answer
        assert 0.9 < waited < 5, waited  # the read timeout, not the request timeout (60 s)
        metrics = httpx.get(f"{base}/metrics").text
        assert 'atencion_requests_total{endpoint="/translate",status="408"} 1.0' in metrics, metrics
        assert httpx.post(f"{base}/translate", json={"sentences": ["el gato"]}).status_code == 200


def test_a_client_that_stalls_in_its_headers_or_idles_is_disconnected_within_the_read_timeout(demo_model_dir):
    with running(demo_model_dir, read_timeout_s=1) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as silent, \
                socket.create_connection(("127.0.0.1", port)) as dribbling, \
                socket.create_connection(("127.0.0.1", port)) as kept_alive:
            began = time.monotonic()
            dribbling.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\n")
            kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.6)  # a byte now and then does not buy more time: the deadline is the headers' whole
            dribbling.sendall(b"Content-Le")
            for connection in (silent, dribbling):
                assert read_until_closed(connection, 10)[0] == b""
            answer, _ = read_until_closed(kept_alive, 10)  # answered, then closed once idle
            waited = time.monotonic() - began
        assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"ok"' in answer, answer
        assert 0.9 < waited < 5, waited
        assert httpx.get(f"{base}/health").status_code == 200


def test_serve_s_read_timeout_option_reaches_the_server_settings(monkeypatch, capsys):
    from atencion.cli import main
    from atencion.serve import run

    given = []
    monkeypatch.setattr(run, "serve_dirs", lambda models, *args, **limits: given.append(limits))
    assert main(["serve", "--model", "demo", "--read-timeout", "2.5"]) in (0, None)
    assert main(["serve", "--model", "demo"]) in (0, None)
    assert [ServeSettings(**limits).read_timeout_s for limits in given] == [2.5, 10.0]
    with pytest.raises(SystemExit) as refused:
        main(["serve", "--model", "demo", "--read-timeout", "0"])
    assert refused.value.code == 2 and "--read-timeout" in capsys.readouterr().err
