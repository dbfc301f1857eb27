"""A request's JSON body as the server reads it: every number one that JSON has and Python reads
(at most ``DIGITS`` digits: Python converts at most 4,300, and no field takes a number near 100),
every string valid Unicode, and the body validated against an endpoint's schema, each fault a 422
naming the field (``Refused``; the OpenAI routes answer it 400, serve/app.py ``_error``)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ..endpoint import SHOWN, Refused, cut, quoted

SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: no Unicode character
DIGITS = 100    # the longest number a body may hold, in digits (Python converts at most 4,300 to an int)


async def read_json(request: Request) -> Any:
    """The body decoded as JSON, whatever its content type says, every number in it one that JSON
    has and Python reads (``_integer``, ``_float``, ``_constant``), every string valid Unicode; a
    422 saying why not otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw.decode("utf-8"), parse_int=_integer, parse_float=_float, parse_constant=_constant)
    except UnicodeDecodeError as err:
        raise Refused(422, f"the body is not UTF-8 (byte 0x{raw[err.start]:02x} at offset {err.start})") from None
    except json.JSONDecodeError as err:
        raise Refused(422, f"the body is not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise Refused(422, "the body is nested too deeply") from None
    except ValueError as err:  # a number the hooks let by and Python cannot read: none known
        raise Refused(422, f"the body is not valid JSON ({cut(str(err))})") from None
    fault = _unreadable(data)
    if fault is not None:
        raise Refused(422, fault)
    return data


@dataclass(frozen=True)
class Unreadable:
    """What the JSON parser puts in place of a number the server does not read; ``why`` says why.
    The parser's hooks know the number but not its field: ``_unreadable`` finds it and names it."""

    why: str


def _integer(literal: str) -> int | Unreadable:
    """An integer literal of the body: at most DIGITS digits. Python converts at most 4,300 (a
    longer one raised ValueError inside json.loads, a 500), and no field takes a number near 100."""
    return _too_long(literal) or int(literal)


def _float(literal: str) -> float | Unreadable:
    """A literal with a fraction or an exponent: at most DIGITS digits, and finite (1e999 reads as inf)."""
    too_long = _too_long(literal)
    if too_long is not None:
        return too_long
    value = float(literal)
    return value if math.isfinite(value) else Unreadable(f"{cut(literal)} is out of range (not a finite number)")


def _constant(name: str) -> Unreadable:
    """NaN, Infinity or -Infinity: Python's JSON reads them; JSON has no such number."""
    return Unreadable(f"{name} is not a number")


def _too_long(literal: str) -> Unreadable | None:
    """A number literal of more than DIGITS digits, refused, or None."""
    digits = sum(c.isdigit() for c in literal)
    if digits > DIGITS:
        return Unreadable(f"a number of {digits} digits, more than the {DIGITS} the server reads")
    return None


def _unreadable(data: Any) -> str | None:
    """Where the decoded JSON ``data`` holds what the server does not read, named as a field
    ("sentences.1: ..."), or None: a number the parser refused (``Unreadable``), or a string that is
    not valid Unicode. JSON may escape half of a surrogate pair alone ("\\ud83d"), which Python
    decodes to a string that no UTF-8 can carry: the tokenizers and the response would fail on it.
    Every string is looked at, field names and the model's name too, walking the body without
    recursion (it may be nested as deep as the parser allows)."""
    stack: list[tuple[str, Any, bool]] = [("", data, False)]
    while stack:
        where, item, is_key = stack.pop()
        if isinstance(item, Unreadable):
            return f"{_field(where)}: {item.why}"
        if isinstance(item, str):
            bad = SURROGATE.search(item)
            if bad is not None:
                what = f"the field name {quoted(item)} is not" if is_key else "not"
                return f"{_field(where)}: {what} valid Unicode (a lone surrogate at character {bad.start() + 1})"
        elif isinstance(item, dict):
            for key, value in reversed(item.items()):  # popped in the body's order
                stack.append((_join(where, key), value, False))
                stack.append((where, key, True))
        elif isinstance(item, list):
            stack.extend((_join(where, i), value, False) for i, value in reversed(list(enumerate(item))))
    return None


def _join(where: str, part: Any) -> str:
    """The path of a field inside ``where``, each part cut (``_cut``): a key may be a megabyte long."""
    part = cut(str(part))
    return f"{where}.{part}" if where else part


def _field(where: str) -> str:
    """A field's path as an error names it: "body" for the whole, cut when nested deep."""
    return cut(where or "body", 2 * SHOWN)


def validate(schema: type[BaseModel], data: Any) -> BaseModel:
    """``data`` validated against ``schema``; a 422 naming the (first) field otherwise."""
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = _field(".".join(cut(str(part)) for part in first.get("loc", ())))
        if first.get("type") == "extra_forbidden":
            raise Refused(422, f"{where}: unknown field") from None
        if first.get("type") == "missing":
            raise Refused(422, f"{where}: required field missing") from None
        raise Refused(422, f"{where}: {first['msg']}") from None
