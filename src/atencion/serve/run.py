"""Load the models and run the server until Ctrl-C or SIGTERM (requests in flight are answered)."""

from __future__ import annotations

import errno
import logging
import socket
import sys
from pathlib import Path

from ..errors import AtencionError
from .app import LoadedModel, ServeSettings, check_api_key, create_app


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
               threads: int = 0, draft: str | None = None, draft_tokens: int = 4, int8: bool = False,
               **limits) -> None:
    """`atencion serve`: load the model directories ``models`` ([NAME=]DIR, the first the default)
    and serve them until Ctrl-C or SIGTERM; ``limits`` are ServeSettings fields (api_key: default
    $ATENCION_API_KEY). With ``draft``, a model directory, /generate decodes speculatively
    (``attach_draft``), ``draft_tokens`` proposed per round. A bad key or a port out of range is
    refused in one line before any model is loaded, a host or port it cannot listen on before
    anything is announced (``serve``). ``int8``: every model decodes with int8 linear layers
    (``quantize_int8``, as `translate --int8`), its draft too. Each model's thread takes ``threads``
    torch threads and builds and measures the decoding kernels for it before the server listens
    (serve/app.py ``warm``), so the first request pays for none of it."""
    import torch

    check_port(port)
    # each model runs on a thread of its own at ``threads`` (ServeSettings.threads); the main thread, the event
    # loop's, at one: an OpenMP team of the main thread's beside a model thread's would make OpenMP throttle
    # the spinning of both (more threads than cores), and every barrier of a decoding step would wait for a
    # wake-up (SmolLM-135M's step: 36 tokens/s on a model thread against 45 on the main thread, 2 cores)
    settings = ServeSettings(**{**limits, "api_key": api_key(limits.get("api_key")),
                                "threads": threads or torch.get_num_threads()})
    torch.set_num_threads(1)
    loaded = load_models(models, device, int8)
    if draft is not None:
        attach_draft(loaded, draft, draft_tokens, device, int8)
    serve(loaded, host, port, settings)


def api_key(given: str | None) -> str | None:
    """The key to require: ``given`` (--api-key), else $ATENCION_API_KEY, else None (no key). An
    empty or blank one, from either, is refused naming where it came from (``check_api_key``),
    rather than read as no key, or as a key that every request without one matches."""
    import os

    if given is not None:
        check_api_key(given, "--api-key")
        return given
    key = os.environ.get("ATENCION_API_KEY")
    check_api_key(key, "ATENCION_API_KEY", "unset it")
    return key


def check_port(port: int) -> None:
    """Refuse a port that is no TCP port, naming --port (getaddrinfo lets 70000 by)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise AtencionError(f"--port {port}: expected a port from 0 to 65535")


def listen(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to ``port`` on each address of ``host`` (as asyncio's create_server binds
    them), for uvicorn to listen on. Bound before the server is announced, so that a port in use,
    a host that is no address of this machine or resolves to none, and a port out of range are
    one line naming --host or --port (exit 2), never uvicorn's log line and exit 3 after
    "serving"; and handed to uvicorn bound, so nothing can take the port in between."""
    check_port(port)
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise AtencionError(f"--host {host}: no address of that name ({reason}); give an address of this machine, "
                            f"127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sockets.append(socket.socket(family, kind, proto))
            sockets[-1].setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sockets[-1].setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sockets[-1].bind(address)
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise AtencionError(cannot_listen(host, port, err)) from None
    return sockets


def cannot_listen(host: str, port: int, err: OSError) -> str:
    """Why the server cannot listen at ``host``:``port``, naming the option to change."""
    reason = err.strerror or str(err)
    if err.errno == errno.EADDRINUSE:
        return (f"--port {port}: in use on {host} ({reason}): something else listens there; choose another port, "
                f"or stop what holds it")
    if err.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host}: not an address of this machine ({reason}); give one of its addresses, "
                f"127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    if err.errno == errno.EACCES:
        return f"--port {port}: no permission to listen on it ({reason}); ports below 1024 need privileges"
    return f"--host {host} --port {port}: cannot listen ({reason})"


def load_models(specs: list[str], device: str = "cpu", int8: bool = False) -> list[LoadedModel]:
    from ..nn.model_dir import load_model_dir

    return [LoadedModel(name, path, *load_model_dir(path, device, int8=int8)) for name, path in parse_models(specs)]


def attach_draft(models: list[LoadedModel], path: str, tokens: int = 4, device: str = "cpu",
                 int8: bool = False) -> None:
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
    draft, draft_tokenizer = load_model_dir(path, device, int8=int8, what="--draft")
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
    """Serve ``models`` at ``host``:``port`` until Ctrl-C or SIGTERM, each request logged as one
    JSON line on stderr; a host or port it cannot listen on is refused before it says it serves."""
    import uvicorn

    sockets = listen(host, port)
    try:
        logging.getLogger("atencion.serve").setLevel(logging.INFO)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logging.getLogger("atencion.serve").addHandler(handler)
        logging.getLogger("atencion.serve").propagate = False
        app = create_app(models, settings)
        names = ", ".join(m.name for m in models)
        bound = sockets[0].getsockname()[1]  # the port the system chose for --port 0
        shown = f"[{host}]" if ":" in host else host
        print(f"atencion serve: {names} on http://{shown}:{bound}/ (Ctrl-C to stop)", file=sys.stderr, flush=True)
        uvicorn.Server(uvicorn_config(app, host, port, settings)).run(sockets=sockets)  # bound: nothing to fail
    finally:
        for sock in sockets:
            sock.close()
