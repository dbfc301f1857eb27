"""The OpenAI protocol, as the clients people use speak it (the ``openai`` SDK, LangChain, Open WebUI,
lm-evaluation-harness's ``local-completions``): GET /v1/models, POST /v1/completions,
/v1/chat/completions and /v1/embeddings, beside atencion's own routes.

Generation goes through the model's continuous-batching loop (decode/continuous.py): each choice of
a request is a ``Sequence`` that joins the running batch at the next step and leaves when it is
done. ``stream: true`` answers Server-Sent Events, one chunk per piece of text as the tokens come
(decode/text.py holds back an incomplete character or the start of a stop string), a last chunk
with ``finish_reason``, the usage when ``stream_options.include_usage`` asks, then ``data: [DONE]``;
a client that leaves ends its sequences at the next step.

A completion's ``prompt`` is text (tokenized as the model's own tokenizer files say, as
``tokenizer(prompt)`` does in transformers: a start token where the tokenizer adds one) or token
ids, one or a list of them; ``echo`` with ``logprobs`` gives each prompt token's log-probability too
(the first token's is null), and ``max_tokens: 0`` with ``echo`` scores the prompt alone: the
log-likelihood requests of lm-evaluation-harness. Chat ``messages`` are rendered by the tokenizer's
chat template as transformers renders them. Log-probabilities are the model's own (softmax of its
logits), whatever the temperature.

Every parameter is honoured or refused in one line naming it: ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` are accepted at their neutral values only, ``tools`` and
the like not at all. Errors have OpenAI's shape (serve/app.py ``_error``), with 400 where atencion's
own routes say 422.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ..decode.continuous import TOP_LOGPROBS, Engine, Event, QueueFull, Sequence
from ..decode.text import REPLACEMENT, TextStream
from ..endpoint import Refused, RequestBody, cut, quoted
from ..errors import AtencionError
from ..nn.inputs import reads_tokens
from ..nn.positional import context_length, position_limit
from .body import read_json, validate

OWNER = "atencion"
MAX_STOPS = 4         # stop strings per request (OpenAI's limit)
MAX_PROMPTS = 64      # prompts in one completion request
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "best_of": 1, "suffix": None,
           "response_format": None, "parallel_tool_calls": None}
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "audio", "modalities", "prediction",
               "reasoning_effort", "web_search_options", "service_tier", "store", "metadata")


# the requests ------------------------------------------------------------------------------------


class StreamOptions(RequestBody):
    include_usage: bool = False


class Sampling(RequestBody):
    """What completions and chat share. ``temperature`` 0 is greedy; ``top_k`` is an extension
    (vLLM's and llama.cpp's): 0 is off. The neutral values of what is not honoured are accepted."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None


class Message(RequestBody):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None
    name: str | None = None


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP_LOGPROBS)
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


class EmbeddingRequest(RequestBody):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


# a request's sequences and their text ------------------------------------------------------------


@dataclass
class Choice:
    """One choice of an answer: its sequence, its text as it comes, its tokens and their
    log-probabilities, and how it ended."""

    index: int
    sequence: Sequence
    text: TextStream
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finish: str | None = None


class Generation:
    """The choices of one request on the model's engine, and their events as they come (on the
    event loop). ``events()`` yields (choice, new text) until every choice is done; whoever stops
    iterating early (a client that left) ends the sequences still running (``close``)."""

    def __init__(self, engine: Engine, tokenizer, prompts: list[list[int]], n: int, body, max_new: int,
                 stops: list[str], logprobs: int | None, echo_logprobs: int | None):
        from ..tasks.lm import render

        self.engine, self.loop, self.prompts = engine, asyncio.get_running_loop(), prompts
        self.queue: asyncio.Queue[tuple[Choice, Event]] = asyncio.Queue()
        stop_ids = tuple(tokenizer.specials.stop) if tokenizer.foreign else ()
        self.choices: list[Choice] = []
        for p, ids in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                generator = None
                if body.seed is not None:
                    generator = torch.Generator().manual_seed((body.seed + index) % 2**64)
                sequence = Sequence(list(ids), max_new, None, body.temperature, body.top_k, body.top_p, generator,
                                    stop_ids, logprobs, echo_logprobs)
                choice = Choice(index, sequence, TextStream(lambda new: render(tokenizer, new), stops), list(ids))
                sequence.on_event = self._hear(choice)
                self.choices.append(choice)

    def _hear(self, choice: Choice):
        def on_event(event: Event) -> None:  # the engine's thread
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (choice, event))
        return on_event

    def start(self) -> None:
        """Queue every choice's sequence (429 when the engine's queue is full)."""
        try:
            self.engine.submit(*(c.sequence for c in self.choices))
        except QueueFull as err:
            raise Refused(429, str(err), {"Retry-After": "1"}) from None
        except AtencionError as err:
            raise Refused(400, str(err)) from None

    async def events(self) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, text to add) as tokens come, then (choice, the rest) once it ends."""
        open_ = len(self.choices)
        while open_:
            choice, event = await self.queue.get()
            if event.error is not None:
                self.close()
                raise Refused(500 if not isinstance(event.error, AtencionError) else 400,
                              f"generation failed: {event.error}")
            if event.prompt is not None:
                choice.prompt_logprobs = event.prompt
            if event.token is not None and choice.finish is None:
                choice.tokens.append(event.token)
                if event.logprob is not None:
                    choice.logprobs.append((event.logprob, event.top or []))
                piece = choice.text.push(event.token)
                if choice.text.stopped:  # a stop string: the text ends here, the sequence at the next step
                    choice.finish = "stop"
                    self.engine.cancel(choice.sequence)
                    open_ -= 1
                    yield choice, piece
                    continue
                if piece:
                    yield choice, piece
            if event.finish is not None and choice.finish is None:
                choice.finish = "stop" if event.finish == "stop" else "length"
                open_ -= 1
                yield choice, choice.text.close()

    def close(self) -> None:
        """End the sequences still running (the client left, or an error ended the request)."""
        for choice in self.choices:
            if choice.finish is None:
                self.engine.cancel(choice.sequence)

    def usage(self) -> dict[str, int]:
        """The tokens of the prompts (each once, whatever ``n``) and of every choice, exactly."""
        prompt = sum(len(ids) for ids in self.prompts)
        completion = sum(len(c.tokens) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# the routes --------------------------------------------------------------------------------------


def add_routes(app: FastAPI, ctx) -> None:
    """The /v1 routes on ``app``, answered from ``ctx`` (serve/app.py's Context)."""

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(m, ctx) for m in ctx.models]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        m = ctx.by_name.get(name)
        if m is None:
            raise Refused(404, f"model: no model named {quoted(name)}; loaded: {sorted(ctx.by_name)}")
        return _model_card(m, ctx)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request, CompletionRequest)
        return await _complete(body, ctx)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _body(request, ChatRequest)
        return await _chat(body, ctx)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        body = await _body(request, EmbeddingRequest)
        return await _embed(body, ctx)


OPENAI_PATHS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/embeddings")
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               429: "rate_limit_error", 500: "server_error", 503: "unavailable_error", 504: "timeout_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in OpenAI's shape: its message, its type by status, the parameter the message
    names first ("max_tokens: ..."), and a code where one is known."""
    param = message.split(":", 1)[0] if ":" in message and _is_param(message.split(":", 1)[0]) else None
    code = {401: "invalid_api_key", 404: "model_not_found" if param == "model" else None,
            429: "rate_limit_exceeded"}.get(status)
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def _is_param(text: str) -> bool:
    return bool(text) and " " not in text and text.replace(".", "").replace("_", "").isalnum()


def _model_card(m, ctx) -> dict[str, Any]:
    return {"id": m.name, "object": "model", "created": ctx.started, "owned_by": OWNER,
            "max_model_len": context_length(m.model.cfg)}


async def _body(request: Request, schema):
    """The JSON body validated against ``schema``, with OpenAI's words for what atencion does not do."""
    data = await read_json(request)
    if isinstance(data, dict):
        for key in UNSUPPORTED:
            if data.get(key) not in (None, [], {}):
                raise Refused(400, f"{key}: not supported by atencion's server (no tool calls, audio or other "
                                   f"modalities); leave it out")
        for key, neutral in NEUTRAL.items():
            if key in data and key in schema.model_fields and data[key] not in (neutral, None, {}) \
                    and not _neutral(key, data[key]):
                raise Refused(400, f"{key}: {cut(json.dumps(data[key]))} is not supported; atencion samples "
                                   f"with temperature, top_p, top_k and seed only (give {json.dumps(neutral)} or "
                                   f"leave it out)")
    return validate(schema, data)


def _neutral(key: str, value: Any) -> bool:
    if key == "response_format":
        return value == {"type": "text"}
    return False


def _model(ctx, name: str | None, what: str):
    """The model ``name`` (None: the first) and its engine, if it generates (``what``: the route)."""
    by_name = ctx.by_name
    if name is not None and name not in by_name:
        raise Refused(404, f"model: no model named {quoted(name)}; loaded: {sorted(by_name)}")
    m = by_name[name] if name is not None else ctx.models[0]
    engine = ctx.workers.get(m.name)
    if not isinstance(engine, Engine):
        from .. import tasks

        raise Refused(400, f"model: {what} needs a decoder-only model that generates; {m.name!r} is "
                           f"{tasks.describe(m.model.cfg)}")
    return m, engine


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise Refused(400, f"stop: {len(stops)} stop strings; at most {MAX_STOPS}")
    return stops


def _check_sampling(body, ctx) -> None:
    """``n`` within the server's limit (serve --max-samples); a temperature or top_p too small for
    float32 refused as /generate refuses it (tasks/lm.py ``SMALLEST``); stream_options without a stream,
    and log-probabilities with one (the chunks carry text, not tokens), refused."""
    from ..tasks.lm import SMALLEST

    if body.stream_options is not None and not body.stream:
        raise Refused(400, "stream_options: only with stream: true")
    asked = body.logprobs if isinstance(body, ChatRequest) else body.logprobs is not None
    if body.stream and asked:
        raise Refused(400, "logprobs: not with stream: true (the stream carries text); ask for them without "
                           "streaming")
    if body.n > ctx.settings.max_samples:
        raise Refused(400, f"n: {body.n} choices, more than the server's limit of {ctx.settings.max_samples} "
                           f"(serve --max-samples)")
    for key in ("temperature", "top_p"):
        if 0 < getattr(body, key) < SMALLEST:
            raise Refused(400, f"{key}: {getattr(body, key)!r} is too small for float32, where sampling runs; "
                               f"give at least {SMALLEST:g}")


def _new_tokens(asked: int | None, prompt: int, m, ctx) -> int:
    """The new tokens a choice may have: ``asked``, or as many as the model's positions and the
    server's limit leave (None); more than the server allows, or than the positions leave, is refused."""
    limit = ctx.settings.max_new_tokens
    positions = context_length(m.model.cfg)
    room = positions - prompt
    if asked is None:
        return max(0, min(limit, room))
    if asked > limit:
        raise Refused(400, f"max_tokens: {asked} is more than the server's limit of {limit} (serve "
                           f"--max-new-tokens)")
    if asked > room:
        raise Refused(400, f"max_tokens: this model's maximum context length is {positions} tokens; the prompt "
                           f"has {prompt} and {asked} new ones were asked for ({prompt + asked})")
    return asked


def _prompts(prompt, m) -> list[list[int]]:
    """A completion's prompts as token ids: text tokenized as transformers' ``tokenizer(text)``
    does (``prompt_ids``), ids as they are."""
    from ..tasks.lm import prompt_ids

    if isinstance(prompt, str):
        texts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        texts = [prompt]
    else:
        texts = list(prompt)
    if not texts:
        raise Refused(400, "prompt: an empty list; give a text, token ids, or a list of them")
    if len(texts) > MAX_PROMPTS:
        raise Refused(400, f"prompt: {len(texts)} prompts, more than the limit of {MAX_PROMPTS}")
    vocab = m.model.cfg.vocab_size
    out = []
    for i, text in enumerate(texts):
        where = "prompt" if len(texts) == 1 else f"prompt.{i}"
        if isinstance(text, str):
            try:
                ids = prompt_ids(m.tokenizer, text)
            except AtencionError as err:
                raise Refused(400, f"{where}: {err}") from None
        else:
            ids = list(text)
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise Refused(400, f"{where}: token id {cut(str(bad))} is outside the vocabulary [0, {vocab})")
        if not ids:
            raise Refused(400, f"{where}: no tokens; give at least one")
        out.append(ids)
    return out


async def _complete(body: CompletionRequest, ctx):
    m, engine = _model(ctx, body.model, "/v1/completions")
    _check_sampling(body, ctx)
    stops = _stops(body.stop)
    prompts = _prompts(body.prompt, m)
    if body.max_tokens == 0 and not body.echo:
        raise Refused(400, "max_tokens: 0 generates nothing; with echo: true it scores the prompt alone")
    new = min(_new_tokens(body.max_tokens, len(ids), m, ctx) for ids in prompts)
    echo_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    generation = Generation(engine, m.tokenizer, prompts, body.n, body, new, stops, body.logprobs, echo_logprobs)
    answer = Answer("cmpl", "text_completion", m.name)
    if body.stream:
        if body.echo:
            raise Refused(400, "echo: not with stream: true; ask for the echo without streaming")
        return _stream(generation, answer, lambda choice, piece: answer.text_chunk(choice, piece), body)
    await _finish(generation, ctx.settings.timeout_s)
    choices = [_completion_choice(c, m.tokenizer, body) for c in generation.choices]
    return answer.whole(choices, generation.usage())


async def _chat(body: ChatRequest, ctx):
    m, engine = _model(ctx, body.model, "/v1/chat/completions")
    if m.tokenizer.chat_template is None:
        raise Refused(400, f"messages: model {m.name!r} has no chat template (tokenizer_config.json or "
                           f"chat_template.jinja), so it cannot read a chat; send the text to /v1/completions")
    _check_sampling(body, ctx)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise Refused(400, "max_tokens: give max_tokens or max_completion_tokens, not both")
    if body.top_logprobs is not None and not body.logprobs:
        raise Refused(400, "top_logprobs: needs logprobs: true")
    stops = _stops(body.stop)
    messages = [{"role": message.role, "content": _content(message, i), **({"name": message.name} if message.name
                 else {})} for i, message in enumerate(body.messages)]
    try:
        ids = m.tokenizer.src.encode(m.tokenizer.src.render_chat(messages))
    except AtencionError as err:
        raise Refused(400, f"messages: {err}") from None
    new = _new_tokens(body.max_completion_tokens or body.max_tokens, len(ids), m, ctx)
    if new == 0:
        raise Refused(400, f"messages: the chat is {len(ids)} tokens, which fills this model's context of "
                           f"{context_length(m.model.cfg)}; shorten it")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    generation = Generation(engine, m.tokenizer, [ids], body.n, body, new, stops, logprobs, None)
    answer = Answer("chatcmpl", "chat.completion", m.name)
    if body.stream:
        return _stream(generation, answer, lambda choice, piece: answer.delta_chunk(choice, piece, m.tokenizer),
                       body, first=answer.role_chunks(generation.choices))
    await _finish(generation, ctx.settings.timeout_s)
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text.text},
                "logprobs": _chat_logprobs(c, m.tokenizer) if body.logprobs else None,
                "finish_reason": c.finish} for c in generation.choices]
    return answer.whole(choices, generation.usage())


def _content(message: Message, i: int) -> str:
    """A message's text: a string, or the text parts of a list (OpenAI's content parts)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise Refused(400, f"messages.{i}.content.{j}: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                               f"are read; got type {quoted(str(part.get('type')))}")
        texts.append(part["text"])
    return "".join(texts)


async def _finish(generation: Generation, timeout_s: float) -> None:
    """Wait until every choice is done (the request's whole answer); 504 after ``timeout_s``, its
    sequences ended."""
    async def consume() -> None:
        async for _ in generation.events():
            pass

    generation.start()
    try:
        await asyncio.wait_for(consume(), timeout_s)
    except asyncio.TimeoutError:
        raise Refused(504, f"no answer within {timeout_s:g} s (the server is busy); retry later, ask for fewer "
                           f"tokens, or stream") from None
    finally:
        generation.close()


class Answer:
    """The envelope of one request's answer (its id, object, creation time and model), whole or
    as stream chunks."""

    def __init__(self, prefix: str, kind: str, model: str):
        self.id, self.kind, self.model = f"{prefix}-{uuid.uuid4().hex[:24]}", kind, model
        self.created = int(time.time())

    def _head(self, kind: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": kind or self.kind, "created": self.created, "model": self.model}

    def whole(self, choices: list[dict], usage: dict[str, int]) -> dict[str, Any]:
        return {**self._head(), "choices": choices, "usage": usage}

    def text_chunk(self, choice: Choice, piece: str) -> dict[str, Any]:
        finished = choice.finish if not piece or choice.text.stopped else None
        return {**self._head(), "choices": [{"index": choice.index, "text": piece, "logprobs": None,
                                             "finish_reason": finished}]}

    def delta_chunk(self, choice: Choice, piece: str, tokenizer) -> dict[str, Any]:
        finished = choice.finish if not piece or choice.text.stopped else None
        return {**self._head("chat.completion.chunk"),
                "choices": [{"index": choice.index, "delta": {"content": piece} if piece else {},
                             "logprobs": None, "finish_reason": finished}]}

    def role_chunks(self, choices: list[Choice]) -> list[dict[str, Any]]:
        return [{**self._head("chat.completion.chunk"),
                 "choices": [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]} for c in choices]

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.kind == "chat.completion" else self.kind
        return {**self._head(kind), "choices": [], "usage": usage}


def _stream(generation: Generation, answer: Answer, chunk, body, first: list[dict] | None = None):
    """Server-Sent Events: ``first`` chunks, one chunk per piece of text, each choice's last chunk
    with its finish_reason (text and end in one chunk where they come together), the usage when
    asked, then [DONE]. The generation starts before the answer does (a full queue is a 429)."""
    generation.start()
    usage = body.stream_options is not None and body.stream_options.include_usage

    async def events():
        try:
            for head in first or []:
                yield _sse(head)
            async for choice, piece in generation.events():
                if piece or choice.finish is not None:
                    yield _sse(chunk(choice, piece))
                if piece and choice.finish is not None and not choice.text.stopped:
                    yield _sse(chunk(choice, ""))
            if usage:
                yield _sse(answer.usage_chunk(generation.usage()))
            yield "data: [DONE]\n\n"
        except Refused as err:
            yield _sse({"error": {"message": str(err), "type": "server_error", "param": None, "code": None}})
        finally:
            generation.close()

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# log-probabilities -------------------------------------------------------------------------------


def _pieces(tokenizer, ids: list[int], start: int = 0) -> tuple[list[str], list[int]]:
    """Each token's text from ``start`` on, as decoding the tokens one more at a time adds it (the
    pieces join into the text), and where it begins in that text."""
    from ..tasks.lm import render

    texts, offsets, before = [], [], render(tokenizer, ids[:start]) if start else ""
    for i in range(start, len(ids)):
        now = render(tokenizer, ids[: i + 1])
        offsets.append(len(before))
        texts.append(now[len(before):] if now.startswith(before) else tokenizer.piece(ids[i]))
        before = now
    return texts, offsets


def _completion_choice(c: Choice, tokenizer, body: CompletionRequest) -> dict[str, Any]:
    from ..tasks.lm import render

    prompt_text = render(tokenizer, c.prompt) if body.echo else ""
    choice = {"index": c.index, "text": prompt_text + c.text.text, "logprobs": None, "finish_reason": c.finish}
    if body.logprobs is None:
        return choice
    ids = (c.prompt if body.echo else []) + c.tokens[: len(c.logprobs)]
    scored = (c.prompt_logprobs or []) if body.echo else []
    scored = scored + c.logprobs
    texts, offsets = _pieces(tokenizer, ids)

    def top(alternatives):
        listed: dict[str, float] = {}
        for t, v in alternatives:  # most likely first: two tokens of one text keep the likelier's value
            listed.setdefault(_one(tokenizer, t), v)
        return listed

    choice["logprobs"] = {"tokens": texts, "token_logprobs": [s[0] for s in scored],
                          "top_logprobs": [None if s[0] is None else top(s[1]) for s in scored],
                          "text_offset": offsets}
    return choice


def _one(tokenizer, token: int) -> str:
    """A token's text on its own; its piece (as the vocabulary names it) where that is no text: a
    special token, or part of a character's bytes (which would all read U+FFFD)."""
    from ..tasks.lm import render

    text = render(tokenizer, [token])
    return text if text and REPLACEMENT not in text else tokenizer.piece(token)


def _chat_logprobs(c: Choice, tokenizer) -> dict[str, Any]:
    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = _one(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**entry(token, logprob), "top_logprobs": [entry(t, v) for t, v in top]}
               for token, (logprob, top) in zip(c.tokens, c.logprobs)]
    return {"content": content}


# embeddings --------------------------------------------------------------------------------------


async def _embed(body: EmbeddingRequest, ctx):
    from ..data.tokenizer import PAD_ID

    name = body.model
    by_name = ctx.by_name
    if name is not None and name not in by_name:
        raise Refused(404, f"model: no model named {quoted(name)}; loaded: {sorted(by_name)}")
    m = by_name[name] if name is not None else ctx.models[0]
    if m.arch != "encoder" or not reads_tokens(m.model.cfg):
        raise Refused(400, f"model: /v1/embeddings needs an encoder that reads text (BERT-like, arch encoder); "
                           f"{m.name!r} is arch {m.arch!r}")
    if body.dimensions is not None and body.dimensions != m.model.cfg.d_model:
        raise Refused(400, f"dimensions: this model's vectors have {m.model.cfg.d_model}; give that or leave it out")
    inputs = body.input
    texts: list = [inputs] if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else list(inputs)
    if not texts or len(texts) > MAX_PROMPTS:
        raise Refused(400, f"input: {len(texts)} inputs; give 1 to {MAX_PROMPTS}")
    pad = m.tokenizer.specials.pad if m.tokenizer.foreign else PAD_ID
    rows, limit = [], min(ctx.settings.max_tokens, position_limit(m.model.cfg) or ctx.settings.max_tokens)
    for i, text in enumerate(texts):
        ids = m.tokenizer.sentence(text) if isinstance(text, str) else list(text)
        if not ids or len(ids) > limit:
            raise Refused(400, f"input.{i}: {len(ids)} tokens; give 1 to {limit}")
        if any(not 0 <= t < m.model.cfg.vocab_size for t in ids):
            raise Refused(400, f"input.{i}: a token id outside the vocabulary [0, {m.model.cfg.vocab_size})")
        rows.append(ids)
    vectors = await ctx.run(m, lambda: pooled(m.model, rows, pad if pad is not None else 0))
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(vector, body.encoding_format)} for i, vector in enumerate(vectors)]
    tokens = sum(len(r) for r in rows)
    return {"object": "list", "data": data, "model": m.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def pooled(model, rows: list[list[int]], pad: int) -> torch.Tensor:
    """An encoder's vector of each row of ids: its output pooled as ``model.pooling`` says (the
    first token's, BERT's [CLS]; the last real token's; or the mean over the real ones), through
    BERT's pooler tanh(W·x + b) when the model has one: the vector its classification head reads."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad, dtype=torch.long)
    real = torch.zeros(len(rows), longest, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)], real[i, : len(r)] = torch.tensor(r), True
    with torch.inference_mode():
        hidden, _ = model.hidden(ids, real[:, None, None, :])
        head = getattr(model, "classifier", None)
        pooling = model.cfg.pooling
        if pooling == "first":
            vector = hidden[:, 0]
        elif pooling == "last":
            vector = hidden[torch.arange(len(rows)), real.long().sum(1) - 1]
        else:
            weights = real.to(hidden.dtype)[:, :, None]
            vector = (hidden * weights).sum(1) / weights.sum(1)
        if head is not None and head.pooler is not None:
            vector = torch.tanh(head.pooler(vector))
    return vector.float()


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.contiguous().numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
