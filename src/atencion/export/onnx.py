"""Export to ONNX: the encoder, and one decoder step with a key/value cache, as two graphs.

``encoder.onnx``
    src_ids (batch, src_len) int64  →  memory (batch, src_len, d_model)
``decoder_step.onnx``
    tgt_ids (batch, new_len) int64 — the new target tokens (one per step when decoding);
    memory (batch, src_len, d_model); src_mask (batch, src_len) bool, True at real tokens;
    past_keys, past_values (N, batch, h, past_len, d_k) — the self-attention cache of the N
    decoder layers (past_len 0 on the first step, whose tgt_ids are BOS)
    →  logits (batch, new_len, vocab), new_keys, new_values (N, batch, h, past_len+new_len, d_k)

Every dimension named above is dynamic except N, h, d_k, d_model and vocab. The cross-attention
keys/values are recomputed from ``memory`` at every step: one (batch·src_len·d_model ×
2·d_model) product per layer and step, for a graph with one cache instead of two.

Both wrappers are small ``nn.Module``s that call the model's own embedding, layers, final
LayerNorm (pre-LN) and generator; they only replace three things that a traced graph cannot
hold: the input checks of ``Transformer.encode``, the Python ``KVCache`` objects of
``DecoderState`` (tensors in and out here), and the position lookup (rows of a fixed table
gathered at ``past_len + arange(new_len)``; sinusoidal and learned tables alike hold
``max_positions`` rows, so positions stop there).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn

from ..nn.attention import causal_mask
from ..nn.cache import KVCache

ENCODER_FILE, DECODER_FILE, CONFIG_FILE = "encoder.onnx", "decoder_step.onnx", "config.json"
OPSET = 18


def _position_table(model, stack) -> Tensor:
    """The stack's absolute positions as one table of max_positions rows."""
    return stack.positions.vectors(model.cfg.max_positions).detach()


class OnnxEncoder(nn.Module):
    """src_ids → memory: the encoder of §3.1, with the padding mask made from ``pad_id``."""

    def __init__(self, model):
        super().__init__()
        self.encoder = model.encoder
        self.pad_id = model.cfg.pad_id
        self.register_buffer("positions", _position_table(model, model.encoder), persistent=False)

    def forward(self, src_ids: Tensor) -> Tensor:
        mask = (src_ids != self.pad_id)[:, None, None, :]
        x = self.encoder.embed(src_ids) + self.positions[: src_ids.size(1)]
        for layer in self.encoder.layers:
            x, _, _ = layer(x, mask)
        if self.encoder.final_norm is not None:
            x = self.encoder.final_norm(x)
        return x


class OnnxDecoderStep(nn.Module):
    """One incremental decoder step (``Transformer.decode_step``) with the self-attention cache
    passed in and out as tensors; encoder-decoder attention recomputes its keys/values."""

    def __init__(self, model):
        super().__init__()
        self.decoder = model.decoder
        self.generator = model.generator
        self.register_buffer("positions", _position_table(model, model.decoder), persistent=False)

    def forward(self, tgt_ids: Tensor, memory: Tensor, src_mask: Tensor, past_keys: Tensor,
                past_values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        past, new = past_keys.size(3), tgt_ids.size(1)
        positions = self.positions.index_select(0, torch.arange(new, device=tgt_ids.device) + past)
        x = self.decoder.embed(tgt_ids) + positions
        self_mask = causal_mask(new, past, tgt_ids.device)
        memory_mask = src_mask[:, None, None, :]
        keys, values = [], []
        for i, layer in enumerate(self.decoder.layers):
            cache = KVCache()
            cache.k, cache.v = past_keys[i], past_values[i]
            x, _, _ = layer(x, self_mask, memory, memory_mask, self_cache=cache)
            keys.append(cache.k)
            values.append(cache.v)
        if self.decoder.final_norm is not None:
            x = self.decoder.final_norm(x)
        return self.generator(x), torch.stack(keys), torch.stack(values)


def _example_inputs(model, batch=2, src_len=5, new_len=2, past_len=3):
    """Inputs for tracing: sizes that differ from each other and from 0 and 1, which torch.export
    would take for constants."""
    cfg = model.cfg
    src = torch.full((batch, src_len), 4 % cfg.vocab_size, dtype=torch.long)
    src[1, -1] = cfg.pad_id
    memory = torch.zeros(batch, src_len, cfg.d_model)
    past = torch.zeros(cfg.decoder_layers, batch, cfg.n_heads, past_len, cfg.d_k)
    tgt = torch.full((batch, new_len), cfg.bos_id, dtype=torch.long)
    return src, (tgt, memory, src != cfg.pad_id, past, past.clone())


def export_onnx(model, directory: str | os.PathLike, tokenizer=None) -> None:
    """Write encoder.onnx, decoder_step.onnx and the model's config.json into the existing
    empty ``directory`` (plus the SentencePiece model(s) and tokenizer.json with a tokenizer).
    Uses torch.onnx's torch.export-based exporter (it needs the onnxscript package)."""
    import torch.onnx
    from torch.export import Dim

    directory = Path(directory)
    model = model.eval()
    src, step_inputs = _example_inputs(model)
    batch, src_len = Dim("batch"), Dim("src_len")
    new_len, past_len = Dim("new_len"), Dim("past_len")
    with torch.no_grad():
        torch.onnx.export(
            OnnxEncoder(model).eval(), (src,), str(directory / ENCODER_FILE), dynamo=True,
            input_names=["src_ids"], output_names=["memory"], opset_version=OPSET,
            dynamic_shapes={"src_ids": {0: batch, 1: src_len}}, external_data=False, verbose=False)
        torch.onnx.export(
            OnnxDecoderStep(model).eval(), step_inputs, str(directory / DECODER_FILE), dynamo=True,
            input_names=["tgt_ids", "memory", "src_mask", "past_keys", "past_values"],
            output_names=["logits", "new_keys", "new_values"], opset_version=OPSET,
            dynamic_shapes={"tgt_ids": {0: batch, 1: new_len}, "memory": {0: batch, 1: src_len},
                            "src_mask": {0: batch, 1: src_len}, "past_keys": {1: batch, 3: past_len},
                            "past_values": {1: batch, 3: past_len}},
            external_data=False, verbose=False)
    model.cfg.save(directory / CONFIG_FILE)
    if tokenizer is not None:
        tokenizer.save(directory)


# running -----------------------------------------------------------------------------------------

class OnnxTranslator:
    """The two exported graphs under onnxruntime, with a greedy search for checks and examples."""

    def __init__(self, directory: str | os.PathLike, threads: int = 0):
        import onnxruntime as ort

        from ..config import ModelConfig

        directory = Path(directory)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        providers = ["CPUExecutionProvider"]
        self.cfg = ModelConfig.load(directory / CONFIG_FILE)
        self.encoder = ort.InferenceSession(str(directory / ENCODER_FILE), options, providers=providers)
        self.decoder = ort.InferenceSession(str(directory / DECODER_FILE), options, providers=providers)

    def encode(self, src_ids):
        return self.encoder.run(None, {"src_ids": src_ids})[0]

    def step(self, tgt_ids, memory, src_mask, past_keys, past_values):
        return self.decoder.run(None, {"tgt_ids": tgt_ids, "memory": memory, "src_mask": src_mask,
                                       "past_keys": past_keys, "past_values": past_values})

    def greedy(self, src_ids, max_len: int):
        """Greedy decoding of a padded numpy batch (PAD and BOS never chosen, as in atencion);
        returns the generated ids per row, without BOS and EOS, at most ``max_len`` of them."""
        import numpy as np

        cfg = self.cfg
        memory = self.encode(src_ids)
        src_mask = src_ids != cfg.pad_id
        n = src_ids.shape[0]
        past_k = past_v = np.zeros((cfg.decoder_layers, n, cfg.n_heads, 0, cfg.d_k), np.float32)
        last = np.full((n, 1), cfg.bos_id, np.int64)
        outputs, done = [[] for _ in range(n)], np.zeros(n, bool)
        banned = sorted({cfg.pad_id, cfg.bos_id} - {cfg.eos_id})
        for _ in range(max_len):
            logits, past_k, past_v = self.step(last, memory, src_mask, past_k, past_v)
            logits = logits[:, -1]
            logits[:, banned] = -np.inf
            best = logits.argmax(-1)
            for i in np.flatnonzero(~done):
                if best[i] == cfg.eos_id:
                    done[i] = True
                else:
                    outputs[i].append(int(best[i]))
            if done.all():
                break
            last = best[:, None].astype(np.int64)
        return outputs
