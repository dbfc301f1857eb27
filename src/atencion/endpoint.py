"""What a task's HTTP endpoint is made of (``TaskSpec.endpoint``; `atencion serve`, serve/app.py, serves
it): ``TaskEndpoint`` (the request schema, the handler, what /info shows), the schemas' common base
``RequestBody``, ``Upload`` (a multipart form's file), and what handlers answer with: ``Refused`` (a
status and one line), ``unprocessable`` (the library's AtencionError as a 422), ``cut`` (what an error
quotes of a request). A handler is ``async handler(body, model, ctx)``: ``model`` a served model
(``name``, ``model``, ``tokenizer``, ``draft``), ``ctx`` the server's context (its ``settings``,
``run(model, work)`` on the model's worker, ``check_length``, ``translate`` through the batcher,
``input_attention``), serve/app.py's ``LoadedModel`` and ``Context``. No torch and no server here:
the task modules import it without importing the server."""

from __future__ import annotations

import math
import re
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

from .errors import AtencionError

SHOWN = 40  # the characters of a request's value an error quotes at most, then "…"


class Refused(AtencionError):
    """A request answered with ``status`` and this message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers


def cut(text: str, limit: int = SHOWN) -> str:
    """``text``, or its first ``limit`` characters and "…": what an error quotes of a request,
    so that a field name or a value of a megabyte is not sent back whole."""
    return text if len(text) <= limit else text[:limit] + "…"


def quoted(text: str) -> str:
    """``text`` cut (``cut``) and quoted as Python quotes a string."""
    return repr(cut(text))


@contextmanager
def unprocessable():
    """An AtencionError raised inside is the request's fault: 422 with its message."""
    try:
        yield
    except Refused:
        raise
    except AtencionError as err:
        raise Refused(422, str(err)) from None


class RequestBody(BaseModel):
    """What every request schema shares: no unknown fields, no conversions, and NaN (which
    Python's JSON reads) refused as not a number, rather than as out of a field's range."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _a_number(cls, value: Any) -> Any:
        if isinstance(value, float) and math.isnan(value):
            raise PydanticCustomError("not_a_number", "NaN is not a number")
        return value


@dataclass(frozen=True)
class Upload:
    """A multipart form's fields: the file (its bytes and name), the model, whether to return attention."""

    data: bytes
    filename: str
    model: str | None = None
    attention: bool = False


@contextmanager
def uploaded(form: Upload):
    """The upload as a file in a temporary folder (its suffix kept: .npy is read as an array); an
    AtencionError raised inside names the upload by its name, never the server's folder, wherever
    the message holds the path."""
    suffix = Path(form.filename).suffix.lower()
    with tempfile.TemporaryDirectory(prefix="atencion-upload-") as folder:
        path = Path(folder) / ("upload" + (suffix if re.fullmatch(r"\.[a-z0-9]{1,5}", suffix) else ""))
        path.write_bytes(form.data)
        try:
            yield path
        except AtencionError as err:
            name = cut(form.filename) or "upload"
            raise AtencionError(str(err).replace(str(path), name).replace(folder, "(the upload)")) from None


@dataclass(frozen=True)
class TaskEndpoint:
    """A task's endpoint, POST /USE (``TaskSpec.use``): the body is validated against ``schema``
    (whose ``model`` field names the model) and answered by ``await handler(body, model, ctx)``, a
    JSON-able dict. /info shows the ``defaults`` fields of the schema as "decoding" of a model whose
    first endpoint this is, with ``server_defaults(settings)``, and adds ``info(model)`` for each
    model that answers it. ``upload``: the handler of a multipart form (``Upload``) for a model that
    reads images or recordings; ``schema`` None: the endpoint takes uploads only. Which models
    answer it and what the 400 to another says come from the spec (``can``, ``needs``)."""

    schema: type[BaseModel] | None
    handler: Callable[[Any, Any, Any], Awaitable[dict[str, Any]]] | None
    defaults: tuple[str, ...] = ()
    server_defaults: Callable[[Any], dict[str, Any]] | None = None
    info: Callable[[Any], dict[str, Any]] | None = None
    upload: Callable[[Upload, Any, Any], Awaitable[dict[str, Any]]] | None = None
