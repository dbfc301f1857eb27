"""`atencion presets`: a tiny model run on an example batch, then every preset's shape and
parameter count beside the count its paper publishes (Table 3's base and big, and the family's:
BERT, GPT-2, T5, SmolLM, TinyLlama, Mistral), each counted on a model built on the meta device
(no memory)."""

from __future__ import annotations

import torch

from ..config import PRESETS, PUBLISHED, ModelConfig
from ..nn.model_dir import build_model


def presets_report(vocab: int = 37000, tiny_vocab: int = 10000) -> str:
    """The report as text: ``vocab`` for base and big, ``tiny_vocab`` for the tiny presets; the
    others take their published vocabularies."""
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=tiny_vocab)
    model = build_model(cfg).eval()
    src = torch.randint(4, cfg.vocab_size, (2, 7))
    src[1, 5:] = cfg.pad_id
    tgt_in = torch.randint(4, cfg.vocab_size, (2, 5))
    tgt_in[:, 0] = cfg.bos_id
    with torch.no_grad():
        logits = model(src, tgt_in)
    lines = [f"tiny model on an example batch: src_ids {tuple(src.shape)} + tgt_in_ids "
             f"{tuple(tgt_in.shape)} -> logits {tuple(logits.shape)}", "",
             f"{'preset':<16}{'arch':<16}{'positions':<11}{'N':>3}{'d_model':>9}{'d_ff':>7}{'h':>4}{'g':>4}{'dropout':>9}"
             f"{'vocab':>8}{'parameters':>13}  published"]
    for name in PRESETS:
        reads_no_tokens = PRESETS[name].get("vocab_size") == 0  # a ViT: no vocabulary; Whisper: its decoder's only
        if reads_no_tokens:
            size = PUBLISHED.get(name, (0,))[0]
        elif name in ("base", "big"):
            size = vocab
        elif name in PUBLISHED or name == "bert-tiny":
            size = PUBLISHED["bert-base" if name == "bert-tiny" else name][0]  # BERT-Tiny: BERT's WordPiece
        else:
            size = tiny_vocab
        vocabulary = {"tgt_vocab_size": size} if reads_no_tokens and size else {"vocab_size": size}
        cfg = ModelConfig.preset(name, **vocabulary)
        with torch.device("meta"):
            n = build_model(cfg).num_parameters()
        published = PUBLISHED[name][1] if name in PUBLISHED and size == PUBLISHED[name][0] else ""
        lines.append(f"{name:<16}{cfg.arch:<16}{cfg.positional:<11}{cfg.n_layers:>3}{cfg.d_model:>9}{cfg.d_ff:>7}"
                     f"{cfg.n_heads:>4}{cfg.kv_heads:>4}{cfg.dropout:>9}{size:>8}{n / 1e6:>12.1f}M  {published}")
    return "\n".join(lines) + "\n"
