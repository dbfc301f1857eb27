"""`atencion serve`: the HTTP API and the attention explorer page, on FastAPI.

Endpoints: GET /health, /info, /metrics, / (the page) and /static/*; POST /translate (a
translator), /generate (a decoder-only language model), /fill-mask (a masked language model) and
/classify (a classifier: JSON texts, or for a ViT or a speech classifier an image or a WAV file
uploaded as a multipart form) and /transcribe (a speech-to-text model: a WAV upload); a model of
another kind is answered 400, saying which endpoints it has. A decoder given a draft model
(``LoadedModel.draft``, `serve --draft`) answers /generate by speculative decoding: the same
greedy text, and samples from the same distribution, as without it; /info names the draft.
Every error is a JSON object ``{"error": "..."}`` with a 4xx status that says what was wrong,
never a traceback, quoting at most ``SHOWN`` characters of any value sent; see ``ServeSettings``
for the limits, and serve/body.py for the numbers a body may hold.

The model endpoints are a table, ``model_endpoints()``: one ``Endpoint`` each, in the spirit of a
litgpt ``LitAPI`` (decode the request, predict, encode the response): each task's use, from its
spec (``TaskSpec.endpoint``, a ``TaskEndpoint`` of endpoint.py: the request schema and handler live
in the task's module, tasks/), then ``OTHER_ENDPOINTS`` (the explorer's /attention). One route
function serves them all: it reads the JSON body, picks the model it names (a model of the wrong
kind is told so, 400, before the body's fields are judged, 422), validates the body against the
entry's schema and awaits the entry's handler with the model and the ``Context`` (its queues:
``run`` on a model's worker, ``translate`` through a translator's batcher). What a model answers
(``LoadedModel.endpoints``), /info's "endpoints", "decoding" and extra fields, the 400's words and
the paths /metrics counts by name all come from the table. So a new task's endpoint is its spec's,
and another is one entry of ``OTHER_ENDPOINTS``; nothing in ``create_app`` changes.

Uploads. An entry with an ``upload`` handler also takes a multipart form (``python-multipart``):
the field ``file`` (an image, PNG or NPY, for a model of inputs kind patches; a WAV file for one of
kind spectrogram), and optionally ``model`` and ``attention`` (true or false). The body-size limit
(413) is the JSON bodies' ``max_body_bytes``; a bad form or file is 422, naming the field and what
was expected. A model that reads text is answered 400 when it gets a file, and a model that reads
files 400 when it gets JSON: each is told which to send.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import traceback
from contextlib import aclosing, asynccontextmanager
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from .. import tasks
from ..config import TWO_STACKS
from ..decode.continuous import Engine
from ..decode.settings import DecodeConfig
from ..endpoint import Refused, RequestBody, Upload, cut, quoted, unprocessable
from ..errors import AtencionError
from ..nn.inputs import input_kind, reads_tokens
from . import openai
from .batching import Batcher, Job, QueueFull, Worker, attention_json, resolve
from .body import read_json, validate
from .metrics import Metrics

log = logging.getLogger("atencion.serve")
FIXED = ("/", "/health", "/info", "/metrics")  # the paths /metrics counts by name besides the model endpoints'
STATIC = ("explorer.js", "explorer.css")
TYPES = {"explorer.js": "text/javascript", "explorer.css": "text/css"}
MESSAGE = 1000  # the characters of an error message at most (a last guard: no message of ours comes near)


@dataclass
class ServeSettings:
    """Batching and limits of the server; each is a command-line option of `atencion serve`."""

    batch_tokens: int = 4096        # source tokens decoded together at most
    max_wait_ms: float = 5.0        # how long a request may wait for others to join its batch
    max_sentences: int = 64         # sentences per request
    max_tokens: int = 256           # subword pieces per sentence (or prompt, or text to fill)
    max_new_tokens: int = 512       # tokens generated per sample (/generate)
    max_samples: int = 16           # samples per /generate request
    threads: int = 0                # torch threads of each model's thread (0: torch's choice)
    max_sequences: int = 32         # sequences a decoder's /v1 requests decode together (1: one at a time)
    max_tokens_in_flight: int = 32768  # their prompt and new tokens together at most
    max_body_bytes: int = 1 << 20   # request body size (413 above it)
    max_queue: int = 256            # requests waiting per model (429 above it)
    timeout_s: float = 60.0         # per request, queueing included (504 after it)
    read_timeout_s: float = 10.0    # to send a request's headers, and its body (408), and to idle between requests
    api_key: str | None = None      # when set, every endpoint but /health needs it

    def __post_init__(self) -> None:
        check_api_key(self.api_key, "api_key")


def check_api_key(key: str | None, where: str, without: str = "") -> None:
    """Refuse a key no request could send: empty or blank (which every request without a key
    would match, while /info says one is needed), or with whitespace at either end (which HTTP
    strips from the header that carries it). ``where`` names where it came from; ``without`` says
    how to serve without a key (default: leave ``where`` out)."""
    if key is None:
        return
    if not key.strip():
        raise AtencionError(f"{where}: the API key is {'empty' if not key else 'blank'}; give a key, or "
                            f"{without or f'leave {where} out'} to serve without one")
    if key != key.strip():
        raise AtencionError(f"{where}: the API key begins or ends with whitespace, which HTTP headers drop; give "
                            f"it without")


@dataclass
class Draft:
    """The draft model of a decoder's speculative decoding (``decode/speculative.py``): its
    directory, the model, and the tokens it proposes per round."""

    path: str
    model: Any
    tokens: int = 4


@dataclass
class LoadedModel:
    name: str
    path: str
    model: Any
    tokenizer: Any
    induction: dict[str, Any] | None = None   # its induction-head scores, once asked (POST /attention)
    draft: Draft | None = None                # /generate decodes speculatively with it (serve --draft)

    @property
    def arch(self) -> str:
        return getattr(self.model.cfg, "arch", "encoder-decoder")

    @property
    def task(self) -> str:
        return tasks.model_task(self.model.cfg)

    @property
    def answers(self) -> list[Endpoint]:
        """The entries of ``model_endpoints()`` whose capability this model has, the endpoint of its
        own task first: a translator translates; a decoder generates, an encoder with <mask> fills
        masks, a classification head classifies."""
        can = [e for e in model_endpoints() if e.capability(self)]
        return sorted(can, key=lambda e: e.name != tasks.TASKS[self.task].use)

    @property
    def endpoints(self) -> list[str]:
        """The names of ``answers``."""
        return [e.name for e in self.answers]


@dataclass
class Context:
    """What a handler needs besides its body and model: the server's models, settings and
    metrics, and each model's queue (a Batcher for a translator, a Worker for the others)."""

    models: list[LoadedModel]
    settings: ServeSettings
    metrics: Metrics
    batchers: dict[str, Batcher] = field(default_factory=dict)
    workers: dict[str, Worker | Engine] = field(default_factory=dict)  # a decoder's: its continuous-batching Engine
    started: int = field(default_factory=lambda: int(time.time()))     # when the server started (/v1/models)

    @property
    def by_name(self) -> dict[str, LoadedModel]:
        return {m.name: m for m in self.models}

    def model(self, name: str | None, endpoint: Endpoint) -> LoadedModel:
        """The model ``name`` (None: the first), if it answers ``endpoint``; 404 or 400 otherwise."""
        by_name = self.by_name
        if name is not None and name not in by_name:
            raise Refused(404, f"model: no model named {quoted(name)}; loaded: {sorted(by_name)}")
        m = by_name[name] if name is not None else self.models[0]
        if endpoint.name not in m.endpoints:
            raise Refused(400, f"/{endpoint.name} needs {endpoint.needs}; model {m.name!r} is "
                               f"{tasks.describe(m.model.cfg)} and answers {', '.join('/' + e for e in m.endpoints)}")
        return m

    async def run(self, m: LoadedModel, work: Callable[[], Any]) -> Any:
        """``work()`` on the model's worker thread; its AtencionError is the request's fault (422)."""
        try:
            return await self.workers[m.name].run(work, self.settings.timeout_s)
        except QueueFull as err:
            raise Refused(429, str(err), {"Retry-After": "1"}) from None
        except asyncio.TimeoutError:
            raise Refused(504, f"no answer within {self.settings.timeout_s:g} s (the server is busy); retry "
                               f"later or ask for less") from None
        except AtencionError as err:
            raise Refused(422, str(err)) from None

    def check_length(self, where: str, text: str, pieces: int | None = None) -> None:
        """422 for a text surely too long to encode, or of more than ``max_tokens`` pieces."""
        limit = self.settings.max_tokens
        if len(text) > 40 * limit:  # surely too many pieces: don't even encode it
            raise Refused(422, f"{where}: {len(text)} characters, too long (at most {limit} subword pieces)")
        if pieces is not None and pieces > limit:
            raise Refused(422, f"{where}: {pieces} subword pieces, more than the limit of {limit}")

    async def translate(self, m: LoadedModel, sentences: list[str], tokens: int, decode: DecodeConfig, nbest: int,
                        attention: bool) -> tuple[list, list | None]:
        """``sentences`` (``tokens`` source pieces) translated by the model's batcher, with the requests
        that arrive with them: each one's ``nbest`` hypotheses and, with ``attention``, its
        cross-attention (``attention_json``). 429 when the queue is full, 504 past the timeout."""
        if attention:
            from ..viz.attention import require_cross_attention

            with unprocessable():
                require_cross_attention(m.model, "attention: true")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        job = Job(sentences, tokens, decode, resolve(loop, future), nbest=nbest, attention=attention)
        try:
            self.batchers[m.name].submit(job)
        except QueueFull as err:
            raise Refused(429, str(err), {"Retry-After": "1"}) from None
        try:
            results, maps = await asyncio.wait_for(future, self.settings.timeout_s)
        except asyncio.TimeoutError:
            job.cancelled = True
            raise Refused(504, f"no answer within {self.settings.timeout_s:g} s (the server is busy); retry "
                               f"later or with fewer sentences") from None
        self.metrics.sentences(len(sentences), tokens, sum(len(hyps[0].tokens) + 1 for hyps in results))
        return results, maps

    @staticmethod
    def input_attention(m: LoadedModel, path: Path) -> dict[str, Any]:
        """``capture_input_attention``'s numbers for the file at ``path`` (an image, a recording)."""
        from ..nn.inputs import read_inputs
        from ..viz.attention import capture_input_attention

        example = read_inputs(m.model.cfg.inputs, [path], lambda i: "file")[0]
        return capture_input_attention(m.model, m.tokenizer, example).to_json()


@dataclass(frozen=True)
class Endpoint:
    """POST /``name``: a model answers it when ``capability(model)``; the body is validated against
    ``schema`` (whose ``model`` field names the model) and answered by ``await handler(body, model,
    context)``, a JSON-able dict. /info shows the ``defaults`` fields of the schema as "decoding" of
    a model whose first endpoint this is, with ``server_defaults(settings)``, and adds ``info(model)``
    for each model that answers it; the 400 to another model says the endpoint ``needs`` this.
    ``upload``: the handler of a multipart form (``Upload``) for a model that reads images or
    recordings; ``schema`` None: the endpoint takes uploads only."""

    name: str
    schema: type[BaseModel] | None
    needs: str
    capability: Callable[[LoadedModel], bool]
    handler: Callable[[Any, LoadedModel, Context], Awaitable[dict[str, Any]]]
    defaults: tuple[str, ...] = ()
    server_defaults: Callable[[ServeSettings], dict[str, Any]] | None = None
    info: Callable[[LoadedModel], dict[str, Any]] | None = None
    upload: Callable[[Upload, LoadedModel, Context], Awaitable[dict[str, Any]]] | None = None


# what each input kind's upload is, in a 422's words
UPLOADS = {"patches": "an image (PNG, or NPY without pickle)", "spectrogram": "a WAV file (PCM)"}
FORM_FIELDS = ("file", "model", "attention")


# the requests ------------------------------------------------------------------------------------


class AttentionRequest(RequestBody):
    """POST /attention: see ``viz.attention.capture_self_attention``; ``induction``: a GPT's
    induction-head scores per head too (``viz.induction``, on repeated random tokens, not the text)."""

    text: str
    model: str | None = None
    max_new_tokens: int = Field(0, ge=0, le=64)
    induction: bool = False


# the handlers: body, model, context -> the answer ------------------------------------------------


async def _attention(body: AttentionRequest, m: LoadedModel, ctx: Context) -> dict[str, Any]:
    """A GPT's or a BERT's self-attention over ``text`` (and a GPT's greedy new tokens after it)."""
    from ..viz.attention import capture_self_attention, self_attention_ids

    ctx.check_length("text", body.text)
    with unprocessable():
        tokens = len(self_attention_ids(m.model, m.tokenizer, body.text)) + body.max_new_tokens
    ctx.check_length("text", body.text, tokens)
    if body.induction and m.arch != "decoder":
        raise Refused(422, f"induction: induction heads are scored on a GPT (arch decoder); model {m.name!r} is "
                           f"arch {m.arch!r}")
    attention = await ctx.run(m, lambda: capture_self_attention(m.model, m.tokenizer, body.text, body.max_new_tokens))
    answer = {"model": m.name, "text": attention.text, "generated": attention.generated,
              "attention": attention_json(attention)}
    if body.induction:
        if m.induction is None:  # a property of the weights: scored once per model
            m.induction = await ctx.run(m, lambda: _induction(m.model))
        answer["induction"] = m.induction
    return answer


def _induction(model) -> dict[str, Any]:
    """Every head's induction scores on 4 rows of random tokens repeated, as long as the model's
    vocabulary and positions allow, up to 50 (``viz.induction.induction_scores``)."""
    from ..nn.positional import position_limit
    from ..viz.induction import induction_scores

    limit = position_limit(model.cfg)
    length = min(50, model.cfg.vocab_size - 4, *([limit // 2] if limit else []))
    with unprocessable():
        scores = induction_scores(model, length=length, rows=4)
    return {**scores.to_dict(), "induction_heads": scores.induction_heads()}


def _task_endpoint(spec) -> Endpoint:
    """The endpoint of a task's use, POST /USE, from its spec (``TaskSpec.endpoint``): what it needs and
    which models can answer it come from the spec too; a translator (two stacks) answers only the
    endpoints of tasks that train two stacks (/translate, /transcribe)."""
    own = spec.endpoint
    capability = (lambda m: spec.can(m.model, m.tokenizer)) if set(spec.archs) & set(TWO_STACKS) \
        else _one_stack(spec.can)
    return Endpoint(spec.use, own.schema, spec.needs, capability, own.handler, own.defaults, own.server_defaults,
                    own.info, own.upload)


def _one_stack(can: Callable[[Any, Any], bool]) -> Callable[[LoadedModel], bool]:
    """A capability from a task's ``TaskSpec.can``: a translator (two stacks) answers /translate only."""
    return lambda m: m.arch not in TWO_STACKS and can(m.model, m.tokenizer)


# the table: one entry per model endpoint, the order /info and the 400 list them in ---------------

ATTENTION = Endpoint("attention", AttentionRequest, "a GPT or a BERT (arch decoder or encoder; a translator's "
                     "attention comes with /translate and attention: true)",
                     lambda m: m.arch in ("encoder", "decoder") and reads_tokens(m.model.cfg), _attention)
OTHER_ENDPOINTS: tuple[Endpoint, ...] = (ATTENTION,)  # the model endpoints that are no task's use


def model_endpoints() -> tuple[Endpoint, ...]:
    """Every model endpoint: each task's (``TaskSpec.endpoint``, in the order tasks/ registers them),
    then ``OTHER_ENDPOINTS``; read when asked, so that a task registered later has its endpoint."""
    return (*(_task_endpoint(spec) for spec in tasks.TASKS.values() if spec.endpoint is not None), *OTHER_ENDPOINTS)


def create_app(models: list[LoadedModel], settings: ServeSettings | None = None) -> FastAPI:
    """The application serving ``models`` (the first is the default)."""
    settings = settings or ServeSettings()
    check_api_key(settings.api_key, "api_key")  # again: a field may be set after ServeSettings checked it
    if not models:
        raise AtencionError("serve: give at least one model")
    ctx = Context(models, settings, Metrics())
    app = FastAPI(title="atencion", lifespan=_lifespan(ctx), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.settings, app.state.metrics, app.state.context = settings, ctx.metrics, ctx
    _answer_errors(app)
    _guard_every_request(app, ctx)
    _fixed_endpoints(app, ctx)
    for endpoint in model_endpoints():  # the model endpoints: the table's
        app.add_api_route("/" + endpoint.name, _route(endpoint, ctx), methods=["POST"], name=endpoint.name)
    openai.add_routes(app, ctx)
    return app


def _lifespan(ctx: Context):
    """The queues of the models while the server runs: a translator's batcher, another model's
    worker; at shutdown the requests in flight are answered first."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        settings = ctx.settings
        for m in ctx.models:
            start = _model_thread(m, settings.threads)
            if "translate" in m.endpoints:
                ctx.batchers[m.name] = Batcher(m.model, m.tokenizer, settings.batch_tokens, settings.max_wait_ms,
                                               settings.max_queue, ctx.metrics.batch, m.name, start)
            elif "generate" in m.endpoints:  # /v1 continuously batched; /generate and /attention between steps
                ctx.workers[m.name] = Engine(m.model, settings.max_sequences, settings.max_tokens_in_flight,
                                             settings.max_queue, m.name, start)
            else:
                ctx.workers[m.name] = Worker(settings.max_queue, m.name, start)
        yield
        for queue in [*ctx.batchers.values(), *ctx.workers.values()]:
            await asyncio.to_thread(queue.stop)
    return lifespan


def _model_thread(m: LoadedModel, threads: int) -> Callable[[], None]:
    """What a model's thread does first: take ``threads`` torch threads (0: torch's choice), and build
    and measure the decoding kernels at the model's shapes (``warm``), before any request comes."""
    def start() -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        warm(m)
    return start


def warm(m: LoadedModel) -> None:
    """Build (once per CPU) and load the decoding kernels, and measure them against F.linear at the shapes of
    the model (and its draft) where it decodes on the CPU in float32 (nn/matvec.py ``warm``), and a decoder's
    whole step against its layers (nn/fused.py ``warm``): on the model's thread, at its threads, as its
    requests will run. Where they cannot be built, one warning line says why."""
    import torch

    from ..nn import fused, matvec

    for model in (m.model, m.draft.model if m.draft is not None else None):
        first = next(model.parameters(), None) if model is not None else None
        if first is not None and first.device.type == "cpu" and first.dtype == torch.float32:
            matvec.warm(model)
            fused.warm(model)  # a decoder's whole step against its layers (one token per request row)


def _answer_errors(app: FastAPI) -> None:
    """Errors: one JSON object, a 4xx status, never a traceback (a bug: 500, its traceback logged)."""
    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        return _error(exc.status, str(exc), exc.headers, request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"{request.url.path}: no such endpoint; see GET /info"
        return _error(exc.status_code, message, getattr(exc, "headers", None), request.url.path)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):
        return _internal_error(request, exc)


def _guard_every_request(app: FastAPI, ctx: Context) -> None:
    """Every request: size limit, key, metrics, one log line."""
    # the paths metrics name; any other is "other"
    counted = {*FIXED, *openai.OPENAI_PATHS, *("/" + e.name for e in model_endpoints())}

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Every response, a 500 included, is counted and logged: an exception raised through
        ``call_next`` would pass this middleware by and reach ``bug`` outside it, so it is
        answered here."""
        began = time.perf_counter()
        path = request.url.path
        endpoint = path if path in counted else "other"
        with ctx.metrics.in_flight(endpoint):
            try:
                response = await _checked(request, call_next, ctx.settings)
            except Exception as exc:  # noqa: BLE001 - a bug: answered 500, and counted like any answer
                response = _internal_error(request, exc)
        seconds = time.perf_counter() - began
        ctx.metrics.request(endpoint, response.status_code, seconds)
        log.info(json.dumps({"method": request.method, "path": path, "status": response.status_code,
                             "ms": round(seconds * 1000, 1),
                             "client": request.client.host if request.client else None}))
        return response


def _fixed_endpoints(app: FastAPI, ctx: Context) -> None:
    """GET /health, /info, /metrics, the explorer page and its files."""
    models, settings = ctx.models, ctx.settings

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": list(ctx.by_name)}

    @app.get("/info")
    async def info():
        return {"models": [_describe(m, settings) for m in models], "default_model": models[0].name,
                "limits": asdict(settings) | {"api_key": settings.api_key is not None}}

    @app.get("/metrics")
    async def prometheus():
        for name, queue in [*ctx.batchers.items(), *ctx.workers.items()]:
            ctx.metrics.queue_depth(name, len(queue))
        return PlainTextResponse(ctx.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(_static("index.html"))

    @app.get("/static/{name}")
    async def static(name: str):
        if name not in STATIC:
            raise Refused(404, f"/static/{name}: no such file")
        return Response(_static(name), media_type=TYPES[name])


def _route(endpoint: Endpoint, ctx: Context) -> Callable[[Request], Awaitable[dict[str, Any]]]:
    """POST /<endpoint>: the JSON body; the model it names, which must answer the endpoint (a model
    of the wrong kind is told so, 400, before the fields are judged, 422); the body validated
    against the endpoint's schema; the handler's answer."""
    async def answer(request: Request) -> dict[str, Any]:
        if request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            form = await _form(request)
            m = ctx.model(form.model, endpoint)
            if endpoint.upload is None or reads_tokens(m.model.cfg):
                raise Refused(400, f"/{endpoint.name}: a file upload needs a model that reads images or recordings "
                                   f"(inputs kind patches or spectrogram); model {m.name!r} reads text: send JSON")
            if not form.data:
                raise Refused(422, f"file: the upload {quoted(form.filename)} is empty; expected "
                                   f"{UPLOADS[input_kind(m.model.cfg).name]}")
            return await endpoint.upload(form, m, ctx)
        data = await read_json(request)
        name = data.get("model") if isinstance(data, dict) else None
        m = ctx.model(name if isinstance(name, str) else None, endpoint)
        if endpoint.schema is None or not reads_tokens(m.model.cfg):
            raise Refused(400, f"/{endpoint.name}: model {m.name!r} reads {input_kind(m.model.cfg).takes}: upload "
                               f"{UPLOADS[input_kind(m.model.cfg).name]} as the multipart form field 'file'")
        return await endpoint.handler(validate(endpoint.schema, data), m, ctx)
    return answer


async def _form(request: Request) -> Upload:
    """The multipart form of an upload (``FORM_FIELDS``); a 422 naming the field otherwise."""
    try:
        form = await request.form(max_files=1, max_fields=len(FORM_FIELDS))
    except (HTTPException, ValueError) as err:
        detail = getattr(err, "detail", None) or str(err)
        raise Refused(422, f"the body is not a valid multipart form ({detail}); expected the fields "
                           f"{', '.join(FORM_FIELDS)}") from None
    unknown = [key for key in form.keys() if key not in FORM_FIELDS]
    if unknown:
        raise Refused(422, f"{cut(unknown[0])}: unknown field; the form takes {', '.join(FORM_FIELDS)}")
    upload, model, attention = form.get("file"), form.get("model"), form.get("attention", "false")
    if upload is None or isinstance(upload, str):
        raise Refused(422, "file: required field missing; expected a file upload (an image or a WAV file)")
    if model is not None and not isinstance(model, str) or not isinstance(attention, str):
        raise Refused(422, f"{'model' if not isinstance(model, str) else 'attention'}: expected text, got a file")
    if attention.lower() not in ("true", "false"):
        raise Refused(422, f"attention: expected true or false, got {attention[:20]!r}")
    data = await upload.read()
    return Upload(data, upload.filename or "", model, attention.lower() == "true")


def _error(status: int, message: str, headers: dict[str, str] | None = None, path: str = "") -> JSONResponse:
    """An error's answer, ``{"error": message}``, the message cut at MESSAGE characters: each
    value of the request it quotes is cut already (``_cut``); this guards against one that was not.
    Under /v1/ it has OpenAI's shape (``openai.error_body``), and what atencion's routes answer 422
    is 400 there, as OpenAI answers it."""
    message = cut(message, MESSAGE)
    if path.startswith("/v1/"):
        status = 400 if status == 422 else status
        return JSONResponse(openai.error_body(status, message), status_code=status, headers=headers)
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _internal_error(request: Request, exc: BaseException) -> JSONResponse:
    """A bug's answer: 500 without the traceback, which goes to the log."""
    log.error("internal error on %s: %s", request.url.path, "".join(traceback.format_exception(exc)))
    return _error(500, f"internal error ({type(exc).__name__}); the server keeps serving", path=request.url.path)


async def _checked(request: Request, call_next, settings: ServeSettings) -> Response:
    """The API key, the body-size limit and the read timeout, before the endpoint runs: a POST's
    body is read here, whole, within ``read_timeout_s`` (408 and the connection closed after it,
    so that a client that stalls mid-body holds nothing), and the endpoint reads it from here."""
    if settings.api_key is not None and request.url.path != "/health":
        given = request.headers.get("x-api-key") or request.query_params.get("key") or ""
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            given = given or bearer[7:]
        if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
            return _error(401, "missing or wrong API key (header X-API-Key or Authorization: Bearer KEY)",
                          path=request.url.path)
    length = request.headers.get("content-length")
    too_large = _error(413, f"the body is larger than {settings.max_body_bytes} bytes", path=request.url.path)
    if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
        return too_large
    if request.method == "POST":
        try:
            body = await asyncio.wait_for(_read_body(request, settings.max_body_bytes), settings.read_timeout_s)
        except asyncio.TimeoutError:
            return _error(408, f"the request body did not arrive within {settings.read_timeout_s:g} s; the "
                               f"connection is closed", {"Connection": "close"}, request.url.path)
        except ClientDisconnect:
            return _error(400, "the client closed the connection before the body was whole", path=request.url.path)
        if body is None:  # chunked, and over the limit
            return too_large
        request._body = body  # the endpoint reads it from here
    return await call_next(request)


async def _read_body(request: Request, limit: int) -> bytes | None:
    """The request's body, or None once it passes ``limit`` bytes (counted while reading: a
    chunked body declares no length)."""
    body = bytearray()
    async with aclosing(request.stream()) as stream:
        async for chunk in stream:
            body += chunk
            if len(body) > limit:
                return None
    return bytes(body)


def _describe(m: LoadedModel, settings: ServeSettings) -> dict[str, Any]:
    """A model for /info: its task ("translate", "lm", "mlm" or "classify"), endpoints, config, the
    defaults of its first endpoint's request ("decoding") and what its endpoints add (``info``)."""
    answers = m.answers
    described = {"name": m.name, "path": m.path, "arch": m.arch, "task": m.task,
                 "endpoints": ["/" + e.name for e in answers], "config": m.model.cfg.to_dict(),
                 "vocab_size": None if m.tokenizer is None else {"source": m.tokenizer.src_vocab_size,
                                                                 "target": m.tokenizer.tgt_vocab_size},
                 "parameters": m.model.num_parameters(),
                 "decoding": _defaults(answers[0], settings) if answers else {}}
    for e in answers:
        if e.info is not None:
            described |= e.info(m)
    return described


def _defaults(endpoint: Endpoint, settings: ServeSettings) -> dict[str, Any]:
    """The request fields /info shows as "decoding": the schema's defaults, then the server's."""
    defaults = {name: endpoint.schema.model_fields[name].default for name in endpoint.defaults}
    if endpoint.server_defaults is not None:
        defaults |= endpoint.server_defaults(settings)
    return defaults


def _static(name: str) -> bytes:
    return resources.files("atencion.serve").joinpath("static", name).read_bytes()
