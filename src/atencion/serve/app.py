"""`atencion serve`: the HTTP API and the attention explorer page, on FastAPI.

Endpoints: GET /health, /info, /metrics, / (the page) and /static/*; POST /translate (and
/generate, /fill-mask, /classify, which answer 400 until a model of their kind is loaded).
Every error is a JSON object ``{"error": "..."}`` with a 4xx status that says what was wrong,
never a traceback; see ``ServeSettings`` for the limits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from ..decode.settings import DecodeConfig
from ..errors import AtencionError
from .batching import Batcher, Job, QueueFull, resolve
from .metrics import Metrics

log = logging.getLogger("atencion.serve")
STATIC = ("explorer.js", "explorer.css")
TYPES = {"explorer.js": "text/javascript", "explorer.css": "text/css"}


@dataclass
class ServeSettings:
    """Batching and limits of the server; each is a command-line option of `atencion serve`."""

    batch_tokens: int = 4096        # source tokens decoded together at most
    max_wait_ms: float = 5.0        # how long a request may wait for others to join its batch
    max_sentences: int = 64         # sentences per request
    max_tokens: int = 256           # subword pieces per sentence
    max_body_bytes: int = 1 << 20   # request body size (413 above it)
    max_queue: int = 256            # requests waiting per model (429 above it)
    timeout_s: float = 60.0         # per request, queueing included (504 after it)
    api_key: str | None = None      # when set, every endpoint but /health needs it


@dataclass
class LoadedModel:
    name: str
    path: str
    model: Any
    tokenizer: Any

    @property
    def arch(self) -> str:
        return getattr(self.model.cfg, "arch", "encoder-decoder")

    @property
    def endpoints(self) -> list[str]:
        return {"encoder-decoder": ["translate"], "decoder": ["generate"],
                "encoder": ["fill-mask", "classify"]}[self.arch]


class TranslateRequest(BaseModel):
    """POST /translate."""

    model_config = ConfigDict(extra="forbid", strict=True)
    sentences: list[str] = Field(min_length=1)
    model: str | None = None
    beam: int = Field(4, ge=1, le=16)
    alpha: float = Field(0.6, ge=0.0, le=10.0)
    nbest: int = Field(1, ge=1, le=16)
    max_len_a: float = Field(1.0, ge=0.0, le=10.0)
    max_len_b: int = Field(50, ge=0, le=1024)
    attention: bool = False


class ModelRequest(BaseModel):
    """The endpoints of other kinds of model: only the model's name matters until one is loaded."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None


class Refused(AtencionError):
    """A request answered with ``status`` and this message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


def create_app(models: list[LoadedModel], settings: ServeSettings | None = None) -> FastAPI:
    """The application serving ``models`` (the first is the default)."""
    settings = settings or ServeSettings()
    if not models:
        raise AtencionError("serve: give at least one model")
    by_name = {m.name: m for m in models}
    metrics = Metrics()
    batchers: dict[str, Batcher] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for m in models:
            if "translate" in m.endpoints:
                batchers[m.name] = Batcher(m.model, m.tokenizer, settings.batch_tokens, settings.max_wait_ms,
                                           settings.max_queue, metrics.batch, m.name)
        yield
        for batcher in batchers.values():  # the requests in flight are answered first
            await asyncio.to_thread(batcher.stop)

    app = FastAPI(title="atencion", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings, app.state.metrics = settings, metrics

    # errors: one JSON object, a 4xx status, never a traceback ------------------------------------

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        return error(exc.status, str(exc), exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"{request.url.path}: no such endpoint; see GET /info"
        return error(exc.status_code, message, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):
        log.error("internal error on %s: %s", request.url.path, "".join(traceback.format_exception(exc)))
        return error(500, f"internal error ({type(exc).__name__}); the server keeps serving")

    # every request: size limit, key, metrics, one log line --------------------------------------

    @app.middleware("http")
    async def guard(request: Request, call_next):
        began = time.perf_counter()
        path = request.url.path
        endpoint = path if path in ENDPOINTS else "other"
        response = await _checked(request, call_next, settings)
        seconds = time.perf_counter() - began
        metrics.request(endpoint, response.status_code, seconds)
        log.info(json.dumps({"method": request.method, "path": path, "status": response.status_code,
                             "ms": round(seconds * 1000, 1),
                             "client": request.client.host if request.client else None}))
        return response

    # the endpoints ---------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(by_name)}

    @app.get("/info")
    async def info():
        return {"models": [_describe(m) for m in models], "default_model": models[0].name,
                "limits": asdict(settings) | {"api_key": settings.api_key is not None}}

    @app.get("/metrics")
    async def prometheus():
        for name, batcher in batchers.items():
            metrics.queue_depth(name, len(batcher))
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(_static("index.html"))

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in STATIC:
            raise Refused(404, f"/static/{name}: no such file")
        return Response(_static(name), media_type=TYPES[name])

    @app.post("/translate")
    async def translate(request: Request):
        body = await _parse(request, TranslateRequest)
        m = _model(by_name, models, body.model, "translate")
        if len(body.sentences) > settings.max_sentences:
            raise Refused(422, f"sentences: {len(body.sentences)} sentences, more than the limit of "
                               f"{settings.max_sentences} per request")
        if body.nbest > body.beam:
            raise Refused(422, f"nbest: {body.nbest} is more than beam ({body.beam})")
        tokens = 0
        for i, sentence in enumerate(body.sentences):
            if not sentence.strip():
                raise Refused(422, f"sentences.{i}: the sentence is empty")
            if len(sentence) > 40 * settings.max_tokens:  # surely too many pieces: don't even encode it
                raise Refused(422, f"sentences.{i}: {len(sentence)} characters, too long (at most "
                                   f"{settings.max_tokens} subword pieces per sentence)")
            pieces = len(m.tokenizer.encode_src(sentence.strip()))
            if pieces > settings.max_tokens:
                raise Refused(422, f"sentences.{i}: {pieces} subword pieces, more than the limit of "
                                   f"{settings.max_tokens}")
            tokens += pieces + 1
        decode = DecodeConfig(beam=body.beam, alpha=body.alpha, max_len_a=body.max_len_a, max_len_b=body.max_len_b)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        job = Job(body.sentences, tokens, decode, resolve(loop, future), nbest=body.nbest, attention=body.attention)
        try:
            batchers[m.name].submit(job)
        except QueueFull as err:
            raise Refused(429, str(err), {"Retry-After": "1"}) from None
        try:
            results, attention = await asyncio.wait_for(future, settings.timeout_s)
        except asyncio.TimeoutError:
            job.cancelled = True
            raise Refused(504, f"no answer within {settings.timeout_s:g} s (the server is busy); retry "
                               f"later or with fewer sentences") from None
        metrics.sentences(len(body.sentences), tokens, sum(len(hyps[0].tokens) + 1 for hyps in results))
        out = []
        for k, hyps in enumerate(results):
            item: dict[str, Any] = {"text": hyps[0].text, "score": round(hyps[0].score, 4),
                                    "nbest": [{"text": h.text, "score": round(h.score, 4)} for h in hyps]}
            if attention is not None:
                item["attention"] = attention[k]
            out.append(item)
        return {"model": m.name, "translations": out}

    for kind in ("generate", "fill-mask", "classify"):
        app.post(f"/{kind}")(_other_kind(kind, by_name, models))

    return app


ENDPOINTS = {"/", "/health", "/info", "/metrics", "/translate", "/generate", "/fill-mask", "/classify"}


async def _checked(request: Request, call_next, settings: ServeSettings) -> Response:
    """The body-size limit and the API key, before the endpoint runs."""
    if settings.api_key is not None and request.url.path != "/health":
        given = request.headers.get("x-api-key") or request.query_params.get("key") or ""
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            given = given or bearer[7:]
        if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
            return JSONResponse({"error": "missing or wrong API key (header X-API-Key or Authorization: "
                                          "Bearer KEY)"}, status_code=401)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
        return JSONResponse({"error": f"the body is larger than {settings.max_body_bytes} bytes"}, status_code=413)
    if request.method == "POST" and length is None:  # chunked: count while reading
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > settings.max_body_bytes:
                return JSONResponse({"error": f"the body is larger than {settings.max_body_bytes} bytes"},
                                    status_code=413)
        request._body = body  # the endpoint reads it from here
    return await call_next(request)


async def _parse(request: Request, schema: type[BaseModel]) -> BaseModel:
    """The JSON body (whatever its content type says) validated against ``schema``; a 4xx naming
    the field otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise Refused(422, f"the body is not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    except json.JSONDecodeError as err:
        raise Refused(422, f"the body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise Refused(422, "the body is nested too deeply") from None
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "body"
        if first.get("type") == "extra_forbidden":
            raise Refused(422, f"{where}: unknown field") from None
        if first.get("type") == "missing":
            raise Refused(422, f"{where}: required field missing") from None
        raise Refused(422, f"{where}: {first['msg']}") from None


def _model(by_name: dict[str, LoadedModel], models: list[LoadedModel], name: str | None, endpoint: str):
    if name is not None and name not in by_name:
        raise Refused(404, f"model: no model named {name!r}; loaded: {sorted(by_name)}")
    m = by_name[name] if name is not None else models[0]
    if endpoint not in m.endpoints:
        fits = {"translate": "an encoder-decoder (translation) model", "generate": "a decoder-only model",
                "fill-mask": "an encoder model", "classify": "an encoder model"}[endpoint]
        raise Refused(400, f"/{endpoint} needs {fits}; model {m.name!r} is {m.arch} and answers "
                           f"{', '.join('/' + e for e in m.endpoints)}")
    return m


def _other_kind(kind: str, by_name, models):
    async def endpoint(request: Request):
        body = await _parse(request, ModelRequest)
        _model(by_name, models, body.model, kind)
        raise Refused(400, f"/{kind}: not available for the loaded models")  # no such model can load yet
    endpoint.__name__ = kind.replace("-", "_")
    return endpoint


def _describe(m: LoadedModel) -> dict[str, Any]:
    task = {"encoder-decoder": "translate", "decoder": "generate", "encoder": "fill-mask"}[m.arch]
    return {"name": m.name, "path": m.path, "arch": m.arch, "task": task,
            "endpoints": ["/" + e for e in m.endpoints], "config": m.model.cfg.to_dict(),
            "vocab_size": {"source": m.tokenizer.src_vocab_size, "target": m.tokenizer.tgt_vocab_size},
            "parameters": m.model.num_parameters(), "decoding": _decoding_defaults()}


def _decoding_defaults() -> dict[str, Any]:
    fields = TranslateRequest.model_fields
    return {name: fields[name].default for name in ("beam", "alpha", "nbest", "max_len_a", "max_len_b")}


def _static(name: str) -> bytes:
    return resources.files("atencion.serve").joinpath("static", name).read_bytes()
