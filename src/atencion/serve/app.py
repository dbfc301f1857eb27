"""`atencion serve`: the HTTP API and the attention explorer page, on FastAPI.

Endpoints: GET /health, /info, /metrics, / (the page) and /static/*; POST /translate (a
translator), /generate (a decoder-only language model), /fill-mask (a masked language model) and
/classify (a classifier); a model of another kind is answered 400, saying which endpoints it has.
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
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from .. import tasks
from ..decode.settings import DecodeConfig
from ..errors import AtencionError
from ..tasks.base import sentence_ids
from ..tasks.classify import classify_probabilities, label_names
from ..tasks.lm import check_prompt, generate_text
from ..tasks.mlm import fill_mask, masked_ids
from .batching import Batcher, Job, QueueFull, Worker, resolve
from .metrics import Metrics

log = logging.getLogger("atencion.serve")
STATIC = ("explorer.js", "explorer.css")
NEW_TOKENS = 100  # /generate's max_new_tokens when a request gives none (at most the server's limit)
TYPES = {"explorer.js": "text/javascript", "explorer.css": "text/css"}


@dataclass
class ServeSettings:
    """Batching and limits of the server; each is a command-line option of `atencion serve`."""

    batch_tokens: int = 4096        # source tokens decoded together at most
    max_wait_ms: float = 5.0        # how long a request may wait for others to join its batch
    max_sentences: int = 64         # sentences per request
    max_tokens: int = 256           # subword pieces per sentence (or prompt, or text to fill)
    max_new_tokens: int = 512       # tokens generated per sample (/generate)
    max_samples: int = 16           # samples per /generate request
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
    def task(self) -> str:
        return tasks.model_task(self.model.cfg)

    @property
    def endpoints(self) -> list[str]:
        """What the model can answer, the endpoint of its own task first: a translator translates;
        a decoder generates, an encoder with <mask> fills masks, a classification head classifies."""
        return tasks.uses(self.model, self.tokenizer)


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


class GenerateRequest(BaseModel):
    """POST /generate: see ``tasks.lm.generate_text``; max_new_tokens None is NEW_TOKENS (at most the limit)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str = ""
    model: str | None = None
    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_samples: int = Field(1, ge=1)


class FillMaskRequest(BaseModel):
    """POST /fill-mask: see ``tasks.mlm.fill_mask``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    text: str
    model: str | None = None
    top_k: int = Field(5, ge=1, le=100)


class ClassifyRequest(BaseModel):
    """POST /classify: see ``tasks.classify.classify_probabilities``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    texts: list[str] = Field(min_length=1)
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
    workers: dict[str, Worker] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        for m in models:
            if "translate" in m.endpoints:
                batchers[m.name] = Batcher(m.model, m.tokenizer, settings.batch_tokens, settings.max_wait_ms,
                                           settings.max_queue, metrics.batch, m.name)
            else:
                workers[m.name] = Worker(settings.max_queue, m.name)
        yield
        for queue in [*batchers.values(), *workers.values()]:  # the requests in flight are answered first
            await asyncio.to_thread(queue.stop)

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
        return {"models": [_describe(m, settings) for m in models], "default_model": models[0].name,
                "limits": asdict(settings) | {"api_key": settings.api_key is not None}}

    @app.get("/metrics")
    async def prometheus():
        for name, queue in [*batchers.items(), *workers.items()]:
            metrics.queue_depth(name, len(queue))
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
        if body.attention:
            from ..viz.attention import require_cross_attention

            try:
                require_cross_attention(m.model, "attention: true")
            except AtencionError as err:
                raise Refused(422, str(err)) from None
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

    async def run(m: LoadedModel, work):
        """``work()`` on the model's worker thread; its AtencionError is the request's fault (422)."""
        try:
            return await workers[m.name].run(work, settings.timeout_s)
        except QueueFull as err:
            raise Refused(429, str(err), {"Retry-After": "1"}) from None
        except asyncio.TimeoutError:
            raise Refused(504, f"no answer within {settings.timeout_s:g} s (the server is busy); retry "
                               f"later or ask for less") from None
        except AtencionError as err:
            raise Refused(422, str(err)) from None

    def model_answers(endpoint: str) -> Callable[[Any], None]:
        """A check that the model a body names answers ``endpoint``, before the body is validated
        against that endpoint's fields: a model of the wrong kind is told so (400) first."""
        def check(data: Any) -> None:
            name = data.get("model") if isinstance(data, dict) else None
            _model(by_name, models, name if isinstance(name, str) else None, endpoint)
        return check

    def check_length(field: str, text: str, pieces: int | None = None) -> None:
        if len(text) > 40 * settings.max_tokens:  # surely too many pieces: don't even encode it
            raise Refused(422, f"{field}: {len(text)} characters, too long (at most {settings.max_tokens} "
                               f"subword pieces)")
        if pieces is not None and pieces > settings.max_tokens:
            raise Refused(422, f"{field}: {pieces} subword pieces, more than the limit of {settings.max_tokens}")

    @app.post("/generate")
    async def generate(request: Request):
        body = await _parse(request, GenerateRequest, model_answers("generate"))
        m = _model(by_name, models, body.model, "generate")
        new_tokens = body.max_new_tokens or min(NEW_TOKENS, settings.max_new_tokens)
        if new_tokens > settings.max_new_tokens:
            raise Refused(422, f"max_new_tokens: {new_tokens} is more than the limit of {settings.max_new_tokens}")
        if body.num_samples > settings.max_samples:
            raise Refused(422, f"num_samples: {body.num_samples} is more than the limit of {settings.max_samples}")
        check_length("prompt", body.prompt)
        try:
            ids = check_prompt(m.model, m.tokenizer, body.prompt, new_tokens, "prompt")
        except AtencionError as err:
            raise Refused(422, str(err)) from None
        check_length("prompt", body.prompt, len(ids))
        texts = await run(m, lambda: generate_text(
            m.model, m.tokenizer, body.prompt, new_tokens, body.temperature, body.top_k, body.top_p, body.seed,
            body.num_samples, what="prompt"))
        return {"model": m.name, "prompt": body.prompt, "texts": texts}

    @app.post("/fill-mask")
    async def fill(request: Request):
        body = await _parse(request, FillMaskRequest, model_answers("fill-mask"))
        m = _model(by_name, models, body.model, "fill-mask")
        check_length("text", body.text)
        try:
            pieces = len(masked_ids(m.tokenizer, body.text, "text")) - 2
        except AtencionError as err:
            raise Refused(422, str(err)) from None
        check_length("text", body.text, pieces)
        masks = await run(m, lambda: fill_mask(m.model, m.tokenizer, body.text, body.top_k, "text"))
        return {"model": m.name, "masks": [[{"token": token, "probability": p} for token, p in mask]
                                           for mask in masks]}

    @app.post("/classify")
    async def classify(request: Request):
        body = await _parse(request, ClassifyRequest, model_answers("classify"))
        m = _model(by_name, models, body.model, "classify")
        if len(body.texts) > settings.max_sentences:
            raise Refused(422, f"texts: {len(body.texts)} texts, more than the limit of {settings.max_sentences} "
                               f"per request")
        for i, text in enumerate(body.texts):
            check_length(f"texts.{i}", text)
        try:
            sentence_ids(m.model, m.tokenizer, body.texts, settings.max_tokens, lambda i: f"texts.{i}")
        except AtencionError as err:
            raise Refused(422, str(err)) from None
        probabilities = await run(m, lambda: classify_probabilities(
            m.model, m.tokenizer, body.texts, settings.batch_tokens, settings.max_tokens, lambda i: f"texts.{i}"))
        names = label_names(m.model)
        predictions = []
        for row in probabilities.tolist():
            best = max(range(len(row)), key=row.__getitem__)
            predictions.append({"label": names[best], "probability": row[best],
                                "probabilities": dict(zip(names, row))})
        return {"model": m.name, "predictions": predictions}

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


async def _parse(request: Request, schema: type[BaseModel], first: Callable[[Any], None] | None = None) -> BaseModel:
    """The JSON body (whatever its content type says) validated against ``schema``; a 4xx naming
    the field otherwise. ``first(data)``, if given, sees the decoded body before it is validated."""
    raw = await request.body()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise Refused(422, f"the body is not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    except json.JSONDecodeError as err:
        raise Refused(422, f"the body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise Refused(422, "the body is nested too deeply") from None
    if first is not None:
        first(data)
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
        raise Refused(400, f"/{endpoint} needs {tasks.USES[endpoint].needs}; model {m.name!r} is "
                           f"{tasks.describe(m.model.cfg)} "
                           f"and answers {', '.join('/' + e for e in m.endpoints)}")
    return m


def _describe(m: LoadedModel, settings: ServeSettings) -> dict[str, Any]:
    """A model for /info: its task ("translate", "lm", "mlm" or "classify"), endpoints, config and
    the defaults of its first endpoint's request ("decoding")."""
    described = {"name": m.name, "path": m.path, "arch": m.arch, "task": m.task,
                 "endpoints": ["/" + e for e in m.endpoints], "config": m.model.cfg.to_dict(),
                 "vocab_size": {"source": m.tokenizer.src_vocab_size, "target": m.tokenizer.tgt_vocab_size},
                 "parameters": m.model.num_parameters(),
                 "decoding": _defaults(m.endpoints[0], settings) if m.endpoints else {}}
    if "classify" in m.endpoints:
        described["labels"] = label_names(m.model)
    return described


def _defaults(endpoint: str, settings: ServeSettings) -> dict[str, Any]:
    schema, names = {"translate": (TranslateRequest, ("beam", "alpha", "nbest", "max_len_a", "max_len_b")),
                     "generate": (GenerateRequest, ("temperature", "top_k", "top_p", "num_samples")),
                     "fill-mask": (FillMaskRequest, ("top_k",)), "classify": (ClassifyRequest, ())}[endpoint]
    defaults = {name: schema.model_fields[name].default for name in names}
    if endpoint == "generate":
        defaults["max_new_tokens"] = min(NEW_TOKENS, settings.max_new_tokens)
    return defaults


def _static(name: str) -> bytes:
    return resources.files("atencion.serve").joinpath("static", name).read_bytes()
