"""atencion: the Transformer of "Attention Is All You Need" and its family (BERT, GPT, T5), to
train, decode, score, serve and inspect.

``Model``, ``ModelConfig``, ``Transformer`` and ``load`` are loaded on first use: ``import
atencion.cli`` then costs no torch, and the command line can load torch where a Ctrl-C becomes
its "interrupted" line instead of a traceback (cli.main)."""

from .interrupt import remembering_ctrl_c

__all__ = ["Model", "ModelConfig", "Transformer", "load"]
__version__ = "0.1.0"

_LAZY = {"Model": ".nn.model", "ModelConfig": ".config", "Transformer": ".nn.transformer"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'atencion' has no attribute {name!r}")
    import importlib

    with remembering_ctrl_c(defer=True):  # a Ctrl-C while torch and numpy load: raised once they have (interrupt.py)
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


def load(directory, map_location="cpu"):
    """The model saved in ``directory`` (config.json + model.safetensors), whatever its ``arch``:
    an encoder-decoder, an encoder (BERT-style), a decoder (GPT-style) or an RNN encoder-decoder."""
    with remembering_ctrl_c(defer=True):
        from .nn.model_dir import load_model
    return load_model(directory, map_location)
