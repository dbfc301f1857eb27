"""What every converter does the same way: refuse a setting the other library cannot express, and
load a converted state dict only when it sets every parameter."""

from __future__ import annotations

from torch import Tensor

from ..errors import AtencionError


def require(cfg, settings: list[tuple[str, object]], who: str, target: str) -> None:
    """Raise AtencionError naming the first (key, value) of ``settings`` that ``cfg`` does not have."""
    for key, value in settings:
        if getattr(cfg, key) != value:
            raise AtencionError(f"{who}: {key}={getattr(cfg, key)!r} cannot be expressed by {target}, which needs "
                                f"{key}={value!r}")


def load_complete(model, state: dict[str, Tensor], who: str):
    """``model`` with ``state`` loaded, once ``state`` covers every parameter; returns it."""
    missing = set(model.state_dict()) - set(state)
    if missing:
        raise AtencionError(f"{who} left parameters unset: {sorted(missing)[:5]}")
    model.load_state_dict(state)
    return model
