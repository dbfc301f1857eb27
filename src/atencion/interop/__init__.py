"""Converters between atencion models and Hugging Face's: ``from_hf(hf_model)`` gives the equal
atencion model for each supported class, ``to_hf(model)`` the reverse (logits equal within 1e-4
in float32, tested on random weights). Each family lives in a module of its own, importer and
exporter together, both walking the family's one name map (``name_map``: atencion name ↔
Hugging Face name, with the pair of functions that turns one into the other; see ``common``).

A new family: one module here with its name map, its config translation, and one entry in
interop/__init__.py's table (IMPORTERS, below). Nothing here imports ``export``: the
``atencion export --format hf`` path (export/hf.py) imports ``marian.to_marian`` from here.

A Hugging Face model directory of any class in IMPORTERS is read by ``hf_dir`` (every command
takes one): from its safetensors directly when the family's module names its ``MODEL_TYPE`` and
splits its importer into ``import_config`` and ``import_state`` (common.py), else through
transformers' own ``from_pretrained`` and the importer here."""

from __future__ import annotations

from importlib import import_module

from ..errors import AtencionError

# Hugging Face class → (module, importer); the exporter of each module is named to_<module>.
IMPORTERS = {
    "MarianMTModel": ("marian", "from_marian"),
    "BertForMaskedLM": ("bert", "from_bert"),
    "BertForSequenceClassification": ("bert", "from_bert"),
    "GPT2LMHeadModel": ("gpt2", "from_gpt2"),
    "GPT2ForSequenceClassification": ("gpt2", "from_gpt2"),
    "T5ForConditionalGeneration": ("t5", "from_t5"),
    "GPTNeoXForCausalLM": ("neox", "from_neox"),
    "BloomForCausalLM": ("bloom", "from_bloom"),
}


def from_hf(hf_model):
    """The atencion model equal to ``hf_model`` (one of IMPORTERS' classes)."""
    name = type(hf_model).__name__
    if name not in IMPORTERS:
        raise AtencionError(f"from_hf: {name} is not supported; supported: {', '.join(sorted(IMPORTERS))}")
    module, function = IMPORTERS[name]
    return getattr(import_module(f".{module}", __name__), function)(hf_model)


def to_hf(model, family: str | None = None):
    """The Hugging Face model equal to ``model``: BERT for an encoder, GPT-2 for a decoder with
    learned positions, Marian for the paper's translator, T5 for a T5-style translator; or the
    ``family`` named (a module of IMPORTERS, e.g. "t5")."""
    cfg = model.cfg
    if cfg.arch == "rnn":
        raise AtencionError("to_hf: arch 'rnn' (the RNN encoder-decoder) has no Hugging Face class to become; "
                            "the classes of interop are Transformers")
    if cfg.moe is not None:
        raise AtencionError("to_hf: moe (mixture-of-experts feed-forward layers) cannot be expressed by the "
                            "Hugging Face classes of interop, which have one dense feed-forward network per layer")
    if cfg.attention is not None and cfg.attention["kind"] not in ("full", "flash"):
        raise AtencionError(f"to_hf: attention.kind {cfg.attention['kind']} cannot be expressed by the Hugging Face "
                            f"classes of interop, which compute eq. (1) (kinds full and flash)")
    if family is None:
        if cfg.arch == "encoder":
            family = "bert"
        elif cfg.arch == "decoder":
            family = "gpt2"
        else:
            family = "t5" if cfg.positional == "t5" else "marian"
    modules = {module for module, _ in IMPORTERS.values()}
    if family not in modules:
        raise AtencionError(f"to_hf: unknown family {family!r}; expected one of {sorted(modules)}")
    module = import_module(f".{family}", __name__)
    exporter = getattr(module, f"to_{family}", None)
    if exporter is None:
        raise AtencionError(f"to_hf: no exporter to {family} yet")
    return exporter(model)
