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
               threads: int = 0, **limits) -> None:
    """`atencion serve`: load the model directories ``models`` ([NAME=]DIR, the first the default)
    and serve them until Ctrl-C or SIGTERM; ``limits`` are ServeSettings fields (api_key: default
    $ATENCION_API_KEY)."""
    import os

    if threads:
        import torch

        torch.set_num_threads(threads)
    settings = ServeSettings(**{**limits, "api_key": limits.get("api_key") or os.environ.get("ATENCION_API_KEY")})
    serve(load_models(models, device), host, port, settings)


def load_models(specs: list[str], device: str = "cpu") -> list[LoadedModel]:
    from ..nn.model_dir import load_model_dir

    return [LoadedModel(name, path, *load_model_dir(path, device)) for name, path in parse_models(specs)]


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
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=settings.timeout_s)
    try:
        uvicorn.Server(config).run()
    except OSError as err:
        raise AtencionError(f"--host {host} --port {port}: cannot listen ({err.strerror or err})") from None
