"""Load the models and run the server until Ctrl-C or SIGTERM (requests in flight are answered)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from ..errors import AtencionError
from .app import LoadedModel, ServeSettings, create_app


def parse_models(specs: list[str]) -> list[tuple[str, str]]:
    """``NAME=DIR`` or ``DIR`` (named after the directory) → (name, directory), names unique."""
    pairs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec.rstrip("/")).name or "model", spec
        if not name or not path:
            raise AtencionError(f"--model {spec!r}: expected DIR or NAME=DIR")
        if name in dict(pairs):
            raise AtencionError(f"--model {spec!r}: the name {name!r} is given twice; use NAME=DIR")
        pairs.append((name, path))
    return pairs


def serve_dirs(models: list[str], host: str = "127.0.0.1", port: int = 8000, device: str = "cpu",
               threads: int = 0, draft: str | None = None, draft_tokens: int = 4, **limits) -> None:
    """`atencion serve`: load the model directories ``models`` ([NAME=]DIR, the first the default)
    and serve them until Ctrl-C or SIGTERM; ``limits`` are ServeSettings fields (api_key: default
    $ATENCION_API_KEY). With ``draft``, a model directory, /generate decodes speculatively
    (``attach_draft``), ``draft_tokens`` proposed per round."""
    import os

    if threads:
        import torch

        torch.set_num_threads(threads)
    settings = ServeSettings(**{**limits, "api_key": limits.get("api_key") or os.environ.get("ATENCION_API_KEY")})
    loaded = load_models(models, device)
    if draft is not None:
        attach_draft(loaded, draft, draft_tokens, device)
    serve(loaded, host, port, settings)


def load_models(specs: list[str], device: str = "cpu") -> list[LoadedModel]:
    from ..nn.model_dir import load_model_dir

    return [LoadedModel(name, path, *load_model_dir(path, device)) for name, path in parse_models(specs)]


def attach_draft(models: list[LoadedModel], path: str, tokens: int = 4, device: str = "cpu") -> None:
    """Give every model that answers /generate the draft model of the directory ``path``, which
    proposes ``tokens`` per round of speculative decoding; a translator, an encoder or a classifier
    is served as it is, without it. Refused in one line before anything is served: no model that
    generates, a draft that is not a decoder, a draft whose vocabulary is not a generating model's
    (naming both directories: ``check_draft``, ``check_draft_vocabulary``), and a model whose cache
    cannot roll back (naming its directory).

    Each model gets a copy of its own: a model's requests run on its own worker thread
    (serve/batching.py), and the draft is then only ever run by the thread of the model it serves."""
    import copy

    from ..decode.speculative import check_draft
    from ..nn.model_dir import load_model_dir
    from ..tasks.lm import check_draft_vocabulary
    from .app import Draft

    generating = [m for m in models if "generate" in m.endpoints]
    if not generating:
        raise AtencionError(f"--draft {path}: no served model generates text (a decoder-only model answers "
                            f"/generate); serve one, or leave --draft out")
    draft, draft_tokenizer = load_model_dir(path, device, what="--draft")
    for number, m in enumerate(generating):
        check_draft(m.model, draft, tokens, f"--model {m.path}", f"--draft {path}")
        check_draft_vocabulary(m.path, m.tokenizer, path, draft_tokenizer)
        m.draft = Draft(path, draft if number == 0 else copy.deepcopy(draft), tokens)


def uvicorn_config(app, host: str, port: int, settings: ServeSettings):
    """uvicorn's configuration of the server: quiet (the app logs each request), the requests in
    flight answered on shutdown (for up to ``timeout_s``), and ``read_timeout_s`` for a client to
    send a request's line and headers (``ReadDeadline``) and for a kept-alive connection to idle;
    the app's middleware gives the body the same time."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                          timeout_graceful_shutdown=settings.timeout_s, timeout_keep_alive=settings.read_timeout_s,
                          http=read_deadline_protocol())


def read_deadline_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol (h11) with a deadline on each request's line and headers:
    a connection that has not sent them whole within ``timeout_keep_alive`` seconds of opening,
    or of its last answer, is closed. uvicorn alone times out only an idle kept-alive connection,
    and any byte stops that clock, so a client that connected and said nothing, or sent half its
    headers and stalled (or sent a byte now and then), would hold its connection for ever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ReadDeadline(H11Protocol):
        answered = 0  # requests answered on this connection

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            self.answered += 1
            super().on_response_complete()
            self._arm()

        def _arm(self) -> None:
            self.loop.call_later(self.timeout_keep_alive, self._expire, self.answered)

        def _expire(self, answered: int) -> None:
            if answered != self.answered:
                return  # a request was answered since: its own deadline runs
            if self.cycle is not None and not self.cycle.response_complete:
                return  # its headers came: the request is being read or answered (the app times its body)
            if not self.transport.is_closing():
                self.transport.close()  # connection_lost tells h11 and the app

    return ReadDeadline


def serve(models: list[LoadedModel], host: str, port: int, settings: ServeSettings) -> None:
    import uvicorn

    logging.getLogger("atencion.serve").setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.getLogger("atencion.serve").addHandler(handler)
    logging.getLogger("atencion.serve").propagate = False
    app = create_app(models, settings)
    names = ", ".join(m.name for m in models)
    print(f"atencion serve: {names} on http://{host}:{port}/ (Ctrl-C to stop)", file=sys.stderr, flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, host, port, settings)).run()
    except OSError as err:
        raise AtencionError(f"--host {host} --port {port}: cannot listen ({err.strerror or err})") from None
