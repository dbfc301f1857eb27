"""Converters between atencion models and Hugging Face's: ``from_hf(hf_model)`` gives the equal
atencion model for each supported class, ``to_hf(model)`` the reverse (logits equal within 1e-4
in float32, tested on random weights). Each family lives in a module of its own (Llama's three
members, Llama, Mistral and Qwen2, share llama.py), importer and exporter together, both
walking the family's one name map (``name_map``: atencion name ↔ Hugging Face name, with the
pair of functions that turns one into the other; see ``common``).

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
    "LlamaForCausalLM": ("llama", "from_llama"),
    "MistralForCausalLM": ("llama", "from_llama"),
    "Qwen2ForCausalLM": ("llama", "from_llama"),
    "ViTForImageClassification": ("vit", "from_vit"),
}
# families exported by another family's module, as to_<family> there
EXPORTED_BY = {"mistral": "llama", "qwen2": "llama"}


def from_hf(hf_model):
    """The atencion model equal to ``hf_model`` (one of IMPORTERS' classes)."""
    name = type(hf_model).__name__
    if name not in IMPORTERS:
        raise AtencionError(f"from_hf: {name} is not supported; supported: {', '.join(sorted(IMPORTERS))}")
    module, function = IMPORTERS[name]
    return getattr(import_module(f".{module}", __name__), function)(hf_model)


def to_hf(model, family: str | None = None):
    """The Hugging Face model equal to ``model``: BERT for an encoder (ViT for one of image
    patches); for a decoder, Llama with RoPE and RMSNorm (Qwen2 with q/k/v biases only, Mistral
    with a sliding window), GPT-2 otherwise; Marian for the paper's translator, T5 for a T5-style translator; or the
    ``family`` named (a module of IMPORTERS, e.g. "t5", or "mistral", "qwen2")."""
    cfg = model.cfg
    if cfg.arch == "rnn":
        raise AtencionError("to_hf: arch 'rnn' (the RNN encoder-decoder) has no Hugging Face class to become; "
                            "the classes of interop are Transformers")
    if cfg.moe is not None:
        raise AtencionError("to_hf: moe (mixture-of-experts feed-forward layers) cannot be expressed by the "
                            "Hugging Face classes of interop, which have one dense feed-forward network per layer")
    if cfg.d_ff == 0:
        raise AtencionError("to_hf: d_ff 0 (blocks without a feed-forward sub-layer) cannot be expressed by the "
                            "Hugging Face classes of interop, whose every layer has one")
    kind = "full" if cfg.attention is None else cfg.attention["kind"]
    if family is None:
        if cfg.arch == "encoder":
            family = "vit" if cfg.inputs is not None and cfg.inputs["kind"] == "patches" else "bert"
        elif cfg.arch == "decoder":
            family = _decoder_family(cfg)
        else:
            family = "t5" if cfg.positional == "t5" else "marian"
    if kind not in ("full", "flash") and not (kind == "window" and family in EXPORTED_BY):
        raise AtencionError(f"to_hf: attention.kind {kind} cannot be expressed by the Hugging Face classes of "
                            f"interop, which compute eq. (1) (kinds full and flash; a window: mistral, qwen2)")
    families = {module for module, _ in IMPORTERS.values()} | set(EXPORTED_BY)
    if family not in families:
        raise AtencionError(f"to_hf: unknown family {family!r}; expected one of {sorted(families)}")
    module = import_module(f".{EXPORTED_BY.get(family, family)}", __name__)
    exporter = getattr(module, f"to_{family}", None)
    if exporter is None:
        raise AtencionError(f"to_hf: no exporter to {family} yet")
    return exporter(model)


def _decoder_family(cfg) -> str:
    """The Hugging Face family a decoder exports to by default."""
    if cfg.positional != "rope" or cfg.norm != "rmsnorm":
        return "gpt2"
    if cfg.qkv_bias and not cfg.bias:
        return "qwen2"
    return "mistral" if cfg.attention is not None and cfg.attention["kind"] == "window" else "llama"
