"""Speed, side by side on one machine, same weights and inputs: atencion vs Hugging Face
MarianMTModel (training and `generate`) vs CTranslate2 (float32, int8); and, for the language
models (the `lm` part), atencion vs GPT2LMHeadModel and BertForMaskedLM, and today's decoder (the
`llama` part: generation of a SmolLM-135M-shaped Llama against LlamaForCausalLM and, on a CPU,
CTranslate2 float32 and int8 on atencion's export of it).

    python -m benchmarks.speed                 # a table
    python -m benchmarks.speed --json          # one JSON object
    python -m benchmarks.speed --quick         # fewer steps and sentences (under 4 minutes)
    python -m benchmarks.speed --parts lm      # one part: train, decode, lm, llama (default: all four)
    python -m benchmarks.speed --smoke         # every part on tiny shapes, in seconds: a check, not a result

Two sizes: Transformer-Tiny (4+4 layers, d_model 128, d_ff 256, 4 heads) and `base`
(6+6, 512, 2048, 8), both with a 10,000-token shared vocabulary and random weights (the same
weights in every engine: the HF model is built from the equivalent MarianConfig, atencion imports
it, CTranslate2 gets atencion's export). Inputs are token ids with the lengths of Multi30k
(train for training batches of ~4,096 target tokens, val for decoding; --data), or synthetic
lengths if the data is not there. With random weights every engine decodes to the maximum
length, which is fixed for all engines (--max-len); decoders are compared on the exact same work,
and `agreement` is the share of sentences whose best hypothesis is identical. The engines decode
in turn, --rounds times (2 with --quick, else 3), and each one's fastest round counts: this
machine's speed drifts by 10-20% from minute to minute.

int8 rows: atencion with dynamic int8 linear layers (nn/quantize.py) against CTranslate2 int8.
With random weights the next-token distributions are flat, so int8 rounding flips choices far
more often than on a trained model: agreement_int8_vs_fp32 here is a floor; docs/results.md
gives the BLEU cost on a trained model.

MFU = achieved training FLOP/s (model FLOPs of the real tokens: 3 × forward matmul FLOPs) over
this machine's fp32 matrix-product peak, measured here with large square matmuls.

The lm part builds each atencion model from its preset with random weights and gives Hugging
Face the same weights (`atencion.interop.to_hf`); each library trains as its users would:
atencion with `sequence_loss`, Hugging Face with `model(..., labels=...)`.
- GPT training: next-character prediction over random text of a 65-character vocabulary (the
  size of tiny Shakespeare's), rows of 256 characters: 16 rows at `gpt-tiny` (4 layers, d_model
  128, 4 heads), 8 at the shape of nanoGPT's Shakespeare model (6 layers, d_model 384, 6 heads).
- BERT MLM training: `bert-tiny` (2 layers, d_model 128, 2 heads) with an 8,000-token vocabulary,
  32 sentences of 8-128 tokens padded to the longest, 15% of the real tokens masked (the loss
  on those only). Tokens/s count the real tokens.
- Generation: `gpt-tiny` continues a 16-character prompt by 200 characters, batch 1 and 16,
  greedy and sampled (temperature 0.8, top-p 0.95; Hugging Face's default top-k 50 switched
  off), atencion's `generate_ids` against `generate(use_cache=True)`, no stop token. The
  engines alternate, each round in the other order; the ratio is the median of the rounds'
  ratios, with their range. `greedy_same` is the share of rows whose greedy tokens are
  identical in both (a mismatch is printed under the table).
- The llama part runs the greedy generation above on a SmolLM-135M-shaped Llama (random weights,
  a 49,152-token vocabulary), and CTranslate2 float32 and int8 (`ct2_generate` on atencion's
  export, the same prompt, no stop token) in the same rounds: a second table gives atencion's
  tokens/s over CTranslate2's (median of the rounds, range) and the share of CTranslate2's rows
  with atencion's greedy tokens. Each CTranslate2 run loads its generator untimed before and
  releases it after (a loaded one slows the engines beside it). On a CPU a third table gives int8
  against int8: atencion's `quantize_int8` against torch's `quantize_dynamic` of the Hugging Face
  model, in the same rounds. With llama-cpp-python installed (opt-in: it builds llama.cpp from
  source), llama.cpp joins batches 1 and 16 on atencion's GGUF export of the same weights (`export
  --format gguf`, float32 and q8_0, with a character vocabulary of the model's size, since the
  file must hold one): a fourth table gives atencion float32 against llama.cpp f32 and atencion
  int8 against llama.cpp q8_0.

On a GPU (--device cuda) the same comparison runs there, CTranslate2 left out; --bf16 trains
under bf16 autocast (both engines) and measures the peak with bf16 matmuls.
"""

from __future__ import annotations

import argparse
import copy
import gc
import gzip
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from atencion.allocator import keep_freed_memory
from benchmarks import bandwidth
from benchmarks.common import DATA, SMOKE_HELP, installed

KIND = "speed"  # a speed benchmark (benchmarks/__init__.py lists the two groups)
SMOKE = False   # --smoke: every part on tiny shapes (smoke_settings)
SIZES = {
    "tiny": dict(n_layers=4, d_model=128, d_ff=256, n_heads=4),
    "base": dict(n_layers=6, d_model=512, d_ff=2048, n_heads=8),
}
VOCAB, PAD, BOS, EOS = 10000, 0, 2, 3


# inputs ------------------------------------------------------------------------------------------

def multi30k_lengths(data: Path, split: str) -> list[tuple[int, int]]:
    """(source, target) lengths in words of Multi30k en-de, or a synthetic stand-in."""
    en, de = data / "tok" / f"{split}.lc.norm.tok.en.gz", data / "tok" / f"{split}.lc.norm.tok.de.gz"
    if en.is_file() and de.is_file():
        with gzip.open(en, "rt", encoding="utf-8") as f, gzip.open(de, "rt", encoding="utf-8") as g:
            return [(len(a.split()), len(b.split())) for a, b in zip(f, g)]
    rng = random.Random(0)
    return [(max(3, int(rng.gauss(13, 4))), max(3, int(rng.gauss(13, 4))))
            for _ in range(29000 if split == "train" else 1014)]


def random_ids(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(4, VOCAB) for _ in range(length)]


def training_batches(lengths, max_tokens: int, n: int, seed: int = 0):
    from atencion.data.batching import collate, token_batches

    rng = random.Random(seed)
    groups = token_batches(lengths, max_tokens, seed=seed)[:n]
    return [collate([(random_ids(lengths[i][0], rng), random_ids(lengths[i][1], rng)) for i in g], PAD, BOS, EOS)
            for g in groups]


# models ------------------------------------------------------------------------------------------

def build_models(size: str, dropout: float):
    """A random Hugging Face Marian model and the atencion model with the same weights."""
    import transformers

    from atencion.interop.marian import from_marian

    s = SIZES[size]
    config = transformers.MarianConfig(
        vocab_size=VOCAB, d_model=s["d_model"], encoder_layers=s["n_layers"], decoder_layers=s["n_layers"],
        encoder_attention_heads=s["n_heads"], decoder_attention_heads=s["n_heads"],
        encoder_ffn_dim=s["d_ff"], decoder_ffn_dim=s["d_ff"], activation_function="relu",
        scale_embedding=True, max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=BOS, bos_token_id=BOS, dropout=dropout, attention_dropout=0.0,
        activation_dropout=0.0, forced_eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.MarianMTModel(config)
    ours = from_marian(hf)
    return hf, ours


# training ----------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_tokens_per_second(engines: dict, batches, warmup: int, device: torch.device, bf16: bool,
                            times: dict | None = None) -> dict:
    """Target tokens per second of forward + label-smoothed loss + backward + Adam step, per
    engine (name: (loss_fn, params)). The engines take turns, one batch each, so that a slow
    moment of a shared machine falls on all of them alike. ``times``, if given, receives each
    engine's list of seconds per timed batch."""
    optimizers = {name: torch.optim.Adam(params, lr=1e-4, betas=(0.9, 0.98), eps=1e-9, fused=True)
                  for name, (_, params) in engines.items()}
    tokens, seconds = 0, dict.fromkeys(engines, 0.0)
    for i, batch in enumerate(batches):
        for name, (loss_fn, _) in engines.items():
            synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(batch)
            (loss / batch.n_tokens).backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            synchronize(device)
            if i >= warmup:
                elapsed = time.perf_counter() - start
                seconds[name] += elapsed
                if times is not None:
                    times.setdefault(name, []).append(elapsed)
        if i >= warmup:
            tokens += batch.n_tokens
    return {name: tokens / seconds[name] for name in engines}


def training_flops(cfg, batches) -> float:
    """3 × the forward matmul FLOPs of the real (non-pad) tokens: projections, FFN, attention
    scores and weighted sums, and the output layer."""
    d, f, n_enc, n_dec, v = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.decoder_layers, cfg.target_vocab_size
    total = 0.0
    for b in batches:
        src_len = (b.src != PAD).sum(1).double()
        tgt_len = (b.tgt_out != PAD).sum(1).double()
        enc = n_enc * (src_len * (2 * 4 * d * d + 2 * 2 * d * f) + 2 * 2 * src_len ** 2 * d)
        dec = n_dec * (tgt_len * (2 * 4 * d * d + 2 * 2 * d * d + 2 * 2 * d * f) + src_len * 2 * 2 * d * d
                       + 2 * 2 * tgt_len ** 2 * d / 2 + 2 * 2 * tgt_len * src_len * d)
        out = tgt_len * 2 * d * v
        total += float((enc + dec + out).sum())
    return 3 * total


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 8) -> float:
    if device.type == "cuda":
        n = 8192
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best


# decoding ----------------------------------------------------------------------------------------

def decode_batches(lengths, n: int, batch_sentences: int, seed: int = 1):
    rng = random.Random(seed)
    srcs = [random_ids(s, rng) + [EOS] for s, _ in lengths[:n]]
    order = sorted(range(len(srcs)), key=lambda i: len(srcs[i]))
    batches = []
    for start in range(0, len(order), batch_sentences):
        rows = order[start: start + batch_sentences]
        width = max(len(srcs[i]) for i in rows)
        ids = torch.full((len(rows), width), PAD, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : len(srcs[i])] = torch.tensor(srcs[i])
        batches.append((rows, ids))
    return srcs, batches


def atencion_decoder(model, batches, n, beam, alpha, max_len):
    """A function that decodes every batch with atencion and returns the best hypotheses."""
    from atencion.decode.search import beam_search

    def run(batches=batches):
        outputs = [None] * n
        for rows, ids in batches:
            for i, hyps in zip(rows, beam_search(model, ids, beam, alpha, 0.0, max_len)):
                outputs[i] = hyps[0].tokens
        return outputs
    return run


def hf_decoder(hf, batches, n, beam, alpha, max_len):
    def run(batches=batches):
        outputs = [None] * n
        with torch.no_grad():
            for rows, ids in batches:
                generated = hf.generate(input_ids=ids, attention_mask=ids != PAD, num_beams=beam,
                                        length_penalty=alpha, early_stopping=True, max_new_tokens=max_len,
                                        do_sample=False, decoder_start_token_id=BOS, eos_token_id=EOS,
                                        pad_token_id=PAD, suppress_tokens=[PAD, BOS], num_return_sequences=1)
                for i, seq in zip(rows, generated.tolist()):
                    tokens = seq[1:]
                    outputs[i] = tokens[: tokens.index(EOS)] if EOS in tokens else [t for t in tokens if t != PAD]
        return outputs
    return run


def ct2_decoder(export_dir, srcs, batches, n, beam, alpha, max_len, compute_type):
    """CTranslate2 on the same batches as the other engines (one translate_batch call each)."""
    from atencion.export.ctranslate2 import ct2_translate

    def run(batches=batches):
        outputs = [None] * n
        for rows, _ in batches:
            translated = ct2_translate(export_dir, [srcs[i] for i in rows], beam=beam, alpha=alpha,
                                       max_len_a=0.0, max_len_b=max_len, compute_type=compute_type,
                                       threads=torch.get_num_threads(), batch_tokens=10**9)
            for i, tokens in zip(rows, translated):
                outputs[i] = tokens
        return outputs
    return run


def time_decoders(decoders: dict, batches, rounds: int) -> tuple[dict, dict]:
    """Outputs and seconds per engine. The engines decode every batch in turn, ``rounds`` times;
    an engine's time is its fastest round, so a slow moment of a shared machine does not land on
    one engine only. Before each timed run an engine decodes a few sentences (warm-up, and the
    loading of a CTranslate2 model); after it, CTranslate2's translators are released: a loaded
    one slows the other engines in this process by about 30% while it waits."""
    from atencion.export.ctranslate2 import release_translators

    rows, ids = batches[0]
    warmup = [(rows[:8], ids[:8])]
    outputs, seconds = {}, {name: float("inf") for name in decoders}
    for _ in range(rounds):
        for name, run in decoders.items():
            run(warmup)
            start = time.perf_counter()
            outputs[name] = run()
            seconds[name] = min(seconds[name], time.perf_counter() - start)
            release_translators()
    return outputs, seconds


def agreement(a, b) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


# language models (the lm part) ------------------------------------------------------------------

CHARS, BERT_VOCAB, MASK = 65, 8000, 4  # a character vocabulary (tiny Shakespeare's 65), BERT's [MASK] id
GPT_SHAPES = {  # name: (gpt-tiny overrides, rows, block)
    "gpt_tiny": ({}, 16, 256),
    "gpt_384": (dict(n_layers=6, d_model=384, d_ff=1536, n_heads=6), 8, 256),  # nanoGPT's Shakespeare model
}
PROMPT, NEW_TOKENS = 16, 200
LLAMA_VOCAB = 49152  # SmolLM-135M's
LLAMA_CPP_PEERS = {"f32": "ours", "q8_0": "ours_int8"}  # a llama.cpp GGUF kind: the atencion engine it is timed against
LLAMA_1B_VOCAB, LLAMA_1B_TOKENS = 32000, 32  # the llama-1b part: TinyLlama-1.1B's vocabulary, tokens timed


def smoke_settings() -> None:
    """--smoke: the module's shapes made tiny, so that every part runs in seconds (not a result)."""
    global SMOKE, NEW_TOKENS, LLAMA_VOCAB, LLAMA_1B_VOCAB
    SMOKE, NEW_TOKENS, LLAMA_VOCAB, LLAMA_1B_VOCAB = True, 4, 512, 512
    GPT_SHAPES.update(gpt_tiny=({}, 2, 32), gpt_384=(dict(n_layers=1, d_model=64, d_ff=128, n_heads=2), 2, 32))


@dataclass
class LMBatch:
    """One training batch of a single-stack model: atencion's ``targets`` (pad where no loss),
    Hugging Face's ``labels``, and the token counts."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    labels: torch.Tensor
    n_tokens: int   # real input tokens: the throughput counts these
    n_targets: int  # tokens with a loss

    def to(self, device) -> "LMBatch":
        return LMBatch(self.input_ids.to(device), self.targets.to(device), self.labels.to(device),
                       self.n_tokens, self.n_targets)


def lm_models(preset: str, vocab: int, **overrides):
    """An atencion model of ``preset`` with random weights and the Hugging Face model equal to it."""
    from atencion import ModelConfig, Transformer
    from atencion.interop import to_hf

    torch.manual_seed(0)
    ours = Transformer(ModelConfig.preset(preset, vocab_size=vocab, **overrides))
    return ours, to_hf(ours)


def shape_name(cfg) -> str:
    return f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, vocab {cfg.vocab_size}"


def gpt_batches(rows: int, block: int, n: int, seed: int = 0) -> list[LMBatch]:
    """Random text: ``rows`` windows of ``block`` + 1 characters; inputs are the first ``block``,
    targets the next character of each. GPT-2 shifts its labels itself (and so has no target
    for the last position)."""
    text = torch.randint(4, CHARS, (n, rows, block + 1), generator=torch.Generator().manual_seed(seed))
    return [LMBatch(t[:, :-1].contiguous(), t[:, 1:].contiguous(), t[:, :-1].contiguous(), rows * block, rows * block)
            for t in text]


def mlm_batches(rows: int, n: int, seed: int = 0) -> list[LMBatch]:
    """Sentences of 8-128 tokens (mean about 40), padded to the longest of their batch; 15% of
    the real tokens replaced by [MASK], the loss on those only (-100 elsewhere for BERT)."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        lengths = [min(128, max(8, int(rng.gauss(40, 20)))) for _ in range(rows)]
        real = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
        ids = torch.randint(5, BERT_VOCAB, real.shape, generator=g).masked_fill(~real, PAD)
        masked = real & (torch.rand(real.shape, generator=g) < 0.15)
        batches.append(LMBatch(ids.masked_fill(masked, MASK), ids.masked_fill(~masked, PAD),
                               ids.masked_fill(~masked, -100), int(real.sum()), int(masked.sum())))
    return batches


def lm_training(ours, hf, hf_loss, batches, warmup: int, device: torch.device, bf16: bool) -> dict:
    """Training tokens/s of both engines on the same batches; the ratio of the totals, and the
    range of the per-batch ratios."""
    from atencion.tasks.loss import sequence_loss

    ours, hf = ours.to(device).train(), hf.to(device).train()
    batches = [b.to(device) for b in batches]
    times: dict = {}
    speeds = train_tokens_per_second({
        "ours": (lambda b: sequence_loss(ours, ours, b.input_ids, b.targets)[0], ours.parameters()),
        "hf": (lambda b: hf_loss(hf, b) * b.n_targets, hf.parameters()),  # its mean loss, as a sum like ours
    }, batches, warmup, device, bf16, times)
    per_batch = [h / o for o, h in zip(times["ours"], times["hf"])]
    return dict(ours_tok_s=speeds["ours"], hf_tok_s=speeds["hf"], ratio=speeds["ours"] / speeds["hf"],
                ratio_min=min(per_batch), ratio_max=max(per_batch))


def gpt_loss(hf, b: LMBatch):
    return hf(input_ids=b.input_ids, labels=b.labels).loss


def bert_loss(hf, b: LMBatch):
    return hf(input_ids=b.input_ids, attention_mask=b.input_ids != PAD, labels=b.labels).loss


def timed_rounds(engines: dict, rounds: int, device: torch.device, reload=(), new: int = 0) -> tuple[dict, dict]:
    """Each engine's last output and its seconds per round; engines take turns, in the other
    order every round. ``engines``: name → run(round, new_tokens). The engines named in
    ``reload`` (CTranslate2's) are loaded by a short untimed run before each timed one and
    released after it: a loaded CTranslate2 engine slows the others in this process while it
    waits (``time_decoders``). Each timed run makes ``new`` tokens (``NEW_TOKENS`` where 0)."""
    from atencion.export.ctranslate2 import release_translators

    new = new or NEW_TOKENS

    for run in engines.values():
        run(0, 4)  # warm-up
    release_translators()
    outputs, seconds = {}, {name: [] for name in engines}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(reversed(engines))):
            if name in reload:
                engines[name](r, 1)
            synchronize(device)
            start = time.perf_counter()
            outputs[name] = engines[name](r, new)
            synchronize(device)
            seconds[name].append(time.perf_counter() - start)
            if name in reload:
                release_translators()
    return outputs, seconds


def lm_generation(ours, hf, rows: int, greedy: bool, rounds: int, device: torch.device, ct2_dir=None,
                  int8: bool = False, gguf_dir=None) -> dict:
    """Generation tokens/s of ``generate_ids`` and Hugging Face's ``generate`` (KV cache, no stop
    token) from one prompt repeated over ``rows``; with ``greedy``, how many rows agree. With
    ``ct2_dir`` (greedy only), CTranslate2 float32 and int8 on the export there (``ct2_generate``,
    the same prompt and settings) are measured in the same rounds: their tokens/s, atencion's
    ratio to each, and their rows' agreement with atencion's. With ``int8`` (CPU), both engines
    again with int8 linear layers in the same rounds: atencion's ``quantize_int8`` against torch's
    dynamic quantization of the Hugging Face model (``quantize_dynamic`` on every ``nn.Linear``,
    its output projection included, as ours quantizes the generator). With ``gguf_dir`` (greedy),
    llama.cpp on the GGUF exports there (model-f32.gguf, model-q8_0.gguf), each row a sequence of
    one llama.cpp batch, in the same rounds: against atencion's float32 and, with ``int8``, its int8."""
    from atencion.decode.sample import generate_ids

    ours, hf = ours.to(device).eval(), hf.to(device).eval()
    models = {"ours": ours, "hf": hf}
    if int8:
        from atencion.nn.quantize import quantize_int8

        models["ours_int8"] = quantize_int8(ours)
        models["hf_int8"] = torch.ao.quantization.quantize_dynamic(copy.deepcopy(hf), {torch.nn.Linear},
                                                                   dtype=torch.qint8)
    prompt = torch.randint(4, CHARS, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    prompt = prompt.expand(rows, -1).contiguous().to(device)
    sampling = dict(temperature=0.0) if greedy else dict(temperature=0.8, top_p=0.95)
    hf_sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=0.8, top_k=0, top_p=0.95)

    def run_ours(model):
        def run(seed, new):
            return generate_ids(model, prompt, new, generator=torch.Generator(device).manual_seed(seed), **sampling)
        return run

    def run_hf(model):
        def run(seed, new):
            torch.manual_seed(seed)
            with torch.no_grad():
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new,
                                     use_cache=True, eos_token_id=None, pad_token_id=PAD, **hf_sampling)
            return out[:, PROMPT:]
        return run

    engines = {name: (run_hf if name.startswith("hf") else run_ours)(model) for name, model in models.items()}
    if ct2_dir is not None:
        engines.update((f"ct2_{kind}", ct2_engine(ct2_dir, prompt, kind)) for kind in ("float32", "int8"))
    # llama.cpp's file of each kind, against the atencion engine of the same precision (q8_0 only beside int8)
    llama_peers = {kind: ours for kind, ours in LLAMA_CPP_PEERS.items() if ours in models} if gguf_dir else {}
    engines.update((f"llamacpp_{kind}", llama_cpp_engine(gguf_dir / f"model-{kind}.gguf", prompt))
                   for kind in llama_peers)
    outputs, seconds = timed_rounds(engines, rounds, device, reload=[name for name in engines if "ct2" in name])
    tokens = rows * NEW_TOKENS
    result = dict(ours_tok_s=tokens / statistics.median(seconds["ours"]),
                  hf_tok_s=tokens / statistics.median(seconds["hf"]), **ratio_over_rounds(seconds, "hf"))
    if greedy:
        result.update(same_rows(outputs["ours"], outputs["hf"]))
    for kind in ("float32", "int8") if ct2_dir is not None else ():
        name = f"ct2_{kind}"
        result[name] = dict(tok_s=tokens / statistics.median(seconds[name]), **ratio_over_rounds(seconds, name),
                            **same_rows(outputs["ours"], outputs[name]))
    for kind, ours_name in llama_peers.items():
        name = f"llamacpp_{kind}"
        result[name] = dict(ours_tok_s=tokens / statistics.median(seconds[ours_name]),
                            tok_s=tokens / statistics.median(seconds[name]),
                            **ratio_over_rounds(seconds, name, ours_name),
                            **same_rows(outputs[ours_name], outputs[name]))
    if int8:
        result["int8"] = dict(ours_tok_s=tokens / statistics.median(seconds["ours_int8"]),
                              hf_tok_s=tokens / statistics.median(seconds["hf_int8"]),
                              **ratio_over_rounds(seconds, "hf_int8", "ours_int8"),
                              **same_rows(outputs["ours_int8"], outputs["hf_int8"]),
                              same_as_float32=same_rows(outputs["ours_int8"], outputs["ours"])["greedy_same"])
    return result


def ratio_over_rounds(seconds: dict, peer: str, ours: str = "ours") -> dict:
    """atencion's speed (engine ``ours``) over ``peer``'s: the median of the rounds' ratios, and their range."""
    ratios = [p / o for o, p in zip(seconds[ours], seconds[peer])]
    return dict(ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))


def same_rows(ours: torch.Tensor, theirs: torch.Tensor) -> dict:
    """The share of rows with identical greedy tokens, and the first new token where any differs."""
    a, b = ours.cpu(), theirs.cpu()
    differ = (a != b).any(dim=0).nonzero()
    return dict(greedy_same=float((a == b).all(dim=1).float().mean()),
                first_difference_at=int(differ[0]) if len(differ) else None)


def ct2_engine(export_dir, prompt: torch.Tensor, compute_type: str):
    """CTranslate2's greedy generation of ``prompt``'s rows (``ct2_generate``: no stop token, as
    the other engines here), as a tensor like theirs."""
    from atencion.export.ctranslate2_decoder import ct2_generate

    def run(seed, new):
        return torch.tensor(ct2_generate(export_dir, prompt.tolist(), new, stop=[], compute_type=compute_type,
                                         threads=torch.get_num_threads()))
    return run


def llama_cpp_engine(path: Path, prompt: torch.Tensor):
    """llama.cpp's greedy continuation of ``prompt``'s rows, each row a sequence of one batch, as
    llama.cpp's own batched example runs them (its C API through llama-cpp-python's bindings:
    ``llama_decode`` of the prompts in one call, then of each row's new token in one call a step,
    the argmax of each row's last logits; no sampler, no stop token), as a tensor like the others'.
    The file is loaded once, untimed; its memory (the key/value cache) is cleared before each run."""
    import llama_cpp
    import numpy as np
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's loading report: errors only
    rows, length = prompt.shape
    model_params = llama_cpp.llama_model_default_params()
    # no extra buffer types (AMX, repacked layouts): on this CPU, which has AMX, llama.cpp 0.3.36's q8_0 product
    # through them crashed (a protection fault in libggml-cpu); without them it runs its AVX-512 kernels
    model_params.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = rows * (length + NEW_TOKENS + 8)  # each sequence gets n_ctx / n_seq_max positions
    params.n_batch, params.n_seq_max = rows * length, rows
    params.n_threads = params.n_threads_batch = torch.get_num_threads()
    ctx = llama_cpp.llama_init_from_model(model, params)
    vocab_size = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(rows * length, 0, rows)

    def decode(tokens: list[list[int]], start: int) -> list[int]:
        """Each row's tokens at positions start, start + 1, ... in sequence ``row``: its next token."""
        width = len(tokens[0])
        for row, ids in enumerate(tokens):
            for j, token in enumerate(ids):
                i = row * width + j
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + j, 1
                batch.seq_id[i][0], batch.logits[i] = row, j == width - 1
        batch.n_tokens = rows * width
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {path}")
        return [int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, (row + 1) * width - 1),
                                          shape=(vocab_size,)).argmax()) for row in range(rows)]

    def run(seed, new):
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        made = [decode(prompt.tolist(), 0)]
        for step in range(1, new):
            made.append(decode([[token] for token in made[-1]], length + step - 1))
        return torch.tensor(made).T
    return run


def gguf_exports(model, out: Path) -> Path:
    """``model`` written to out/model-f32.gguf and out/model-q8_0.gguf, with a character vocabulary
    of its size (llama.cpp needs one in the file; the engines here exchange token ids only)."""
    from atencion.data.tokenizer import SPECIALS, CharVocab, Tokenizer
    from atencion.export import export

    size = model.cfg.vocab_size - len(SPECIALS)
    tokenizer = Tokenizer(CharVocab([*SPECIALS, *(chr(0x10000 + i) for i in range(size))]))
    for kind, dtype in (("f32", None), ("q8_0", "q8_0")):  # the kinds of LLAMA_CPP_PEERS
        export(model, out / kind, "gguf", tokenizer, dtype)
        (out / kind / "model.gguf").rename(out / f"model-{kind}.gguf")
    return out


def lm_part(args, device: torch.device) -> dict:
    """GPT and BERT training, and generation, each a row: atencion and Hugging Face tokens/s and
    their ratio (with its range), and the shape it was measured at."""
    result = {}
    steps, warmup = (4, 1) if args.quick else (12, 2)
    big_steps = 2 if args.quick else 6
    if SMOKE:
        steps, big_steps = 2, 1
    if device.type == "cuda":
        steps, big_steps = steps * 5, big_steps * 10
    for name, (overrides, rows, block) in GPT_SHAPES.items():
        ours, hf = lm_models("gpt-tiny", CHARS, **overrides)
        n = steps if name == "gpt_tiny" else big_steps
        row = lm_training(ours, hf, gpt_loss, gpt_batches(rows, block, n + warmup), warmup, device, args.bf16)
        result[f"{name}_train"] = dict(row, shape=f"{shape_name(ours.cfg)}; {rows} rows x {block} characters")
    ours, hf = lm_models("bert-tiny", BERT_VOCAB)
    sentences = 4 if SMOKE else 32
    row = lm_training(ours, hf, bert_loss, mlm_batches(sentences, 2 * steps + warmup), warmup, device, args.bf16)
    result["bert_tiny_mlm"] = dict(row, shape=f"{shape_name(ours.cfg)}; {sentences} sentences of 8-128 tokens, "
                                              "15% masked")
    ours, hf = lm_models("gpt-tiny", CHARS)
    rounds = args.rounds + 1
    for rows in (1, 16):
        for greedy in (True, False):
            row = lm_generation(ours, hf, rows, greedy, rounds, device)
            how = "greedy" if greedy else "sampled (T 0.8, top-p 0.95)"
            result[f"generate_b{rows}_{'greedy' if greedy else 'sample'}"] = dict(
                row, shape=f"{shape_name(ours.cfg)}; {PROMPT} + {NEW_TOKENS} tokens, batch {rows}, {how}")
    return result


def llama_part(args, device: torch.device) -> dict:
    """Generation of today's decoder: a Llama-style model of SmolLM-135M's shape (RMSNorm, SwiGLU,
    RoPE, 3 key/value heads of 9; random weights) against Hugging Face's LlamaForCausalLM made
    equal to it by ``to_hf``, and on a CPU CTranslate2 (float32 and int8) on atencion's export of
    it, greedy, batch 1 and 16. Each row's ``wall``: every engine's weight bytes read per token ×
    tokens/s (``wall_rates``), over the machine's read bandwidth measured in the same run (``main``)."""
    import tempfile

    ours, hf = lm_models("smollm-135m", LLAMA_VOCAB, **(dict(n_layers=2) if SMOKE else {}))
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        ct2_dir = None
        if device.type == "cpu" and installed("ctranslate2", "CTranslate2's rows"):  # CTranslate2: CPU only
            from atencion.export import export

            ct2_dir = Path(tmp) / "ct2"
            export(ours, ct2_dir, "ctranslate2")
        gguf_dir = None
        if device.type == "cpu" and installed("llama_cpp", "llama.cpp's rows"):  # llama.cpp: opt-in, CPU here
            gguf_dir = gguf_exports(ours, Path(tmp) / "gguf")
        step_bytes = engine_bytes(ours, gguf_dir)
        for rows in (1, 16):
            row = lm_generation(ours, hf, rows, True, args.rounds + 1, device, ct2_dir, int8=device.type == "cpu",
                                gguf_dir=gguf_dir)
            shape = f"{shape_name(ours.cfg)}, {ours.cfg.n_kv_heads} key/value heads; {PROMPT} + {NEW_TOKENS} tokens"
            row["wall"] = wall_rates(row, rows, step_bytes)
            result[f"llama_b{rows}_greedy"] = dict(row, shape=f"{shape}, batch {rows}, greedy")
    return result


def llama_1b_part(args, device: torch.device) -> dict:
    """Batch-1 generation at a 1B-class shape, where the weights fit no cache: TinyLlama-1.1B's (22 layers,
    d_model 2048, 32 heads, 4 key/value heads, d_ff 5632, vocabulary 32,000; 4.4 GB in float32) with random
    weights, ``LLAMA_1B_TOKENS`` greedy tokens after the prompt, atencion float32 and int8 against llama.cpp
    f32 and q8_0 on its GGUF export (without llama-cpp-python, atencion alone), in the same rounds. Hugging
    Face is left out here: a third copy of the weights. The row's ``wall`` as in ``llama_part``."""
    import tempfile

    from atencion import ModelConfig, Transformer
    from atencion.decode.sample import generate_ids
    from atencion.nn.quantize import quantize_int8

    torch.manual_seed(0)
    overrides = dict(n_layers=2, d_model=128, d_ff=352, n_heads=4, n_kv_heads=2) if SMOKE else {}
    ours = Transformer(ModelConfig.preset("tinyllama-1.1b", vocab_size=LLAMA_1B_VOCAB, **overrides)).eval()
    prompt = torch.randint(4, CHARS, (1, PROMPT), generator=torch.Generator().manual_seed(2)).to(device)
    new = 4 if SMOKE else LLAMA_1B_TOKENS

    def run_ours(model):
        def run(seed, new):
            return generate_ids(model, prompt, new, temperature=0.0)
        return run

    with tempfile.TemporaryDirectory() as tmp:
        gguf_dir = None
        if device.type == "cpu" and installed("llama_cpp", "llama.cpp's rows"):
            gguf_dir = gguf_exports(ours, Path(tmp) / "gguf")  # first: the export's own copies freed before int8's
            gc.collect()
        models = {"ours": ours, "ours_int8": quantize_int8(ours)} if device.type == "cpu" else {"ours": ours.to(device)}
        engines = {name: run_ours(model) for name, model in models.items()}
        if gguf_dir is not None:
            engines.update((f"llamacpp_{kind}", llama_cpp_engine(gguf_dir / f"model-{kind}.gguf", prompt.cpu()))
                           for kind in LLAMA_CPP_PEERS)
        step_bytes = engine_bytes(ours, gguf_dir)
        outputs, seconds = timed_rounds(engines, args.rounds + 1, device, new=new)
    row = dict(ours_tok_s=new / statistics.median(seconds["ours"]),
               shape=f"{shape_name(ours.cfg)}, {ours.cfg.n_kv_heads} key/value heads; {PROMPT} + {new} tokens, "
                     "batch 1, greedy")
    if "ours_int8" in seconds:
        row["int8"] = dict(ours_tok_s=new / statistics.median(seconds["ours_int8"]))
    for kind, ours_name in LLAMA_CPP_PEERS.items():
        name = f"llamacpp_{kind}"
        if name in seconds:
            row[name] = dict(ours_tok_s=new / statistics.median(seconds[ours_name]),
                             tok_s=new / statistics.median(seconds[name]),
                             **ratio_over_rounds(seconds, name, ours_name),
                             **same_rows(outputs[ours_name], outputs[name]))
    if row.get("llamacpp_f32", {}).get("first_difference_at") is not None:
        row["llamacpp_f32"]["margin_there"] = greedy_margin(ours, prompt, outputs["ours"],
                                                            row["llamacpp_f32"]["first_difference_at"])
    row["wall"] = wall_rates(row, 1, step_bytes)
    return {"llama1b_b1_greedy": row}


def greedy_margin(model, prompt: torch.Tensor, made: torch.Tensor, at: int) -> float:
    """How far apart ``model``'s two largest logits are where it chose new token ``at`` of ``made`` (row 0) after
    ``prompt``: where another engine's greedy tokens first differ, a margin of float32 rounding's size says the
    two engines differ in the last bits of a near tie, not in what they compute."""
    with torch.no_grad():
        logits = model(torch.cat([prompt, made[:1, :at].to(prompt.device)], 1))[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def step_bytes_of(model, int8: bool = False) -> int:
    """The weight bytes one generation step of atencion's ``model`` reads: every parameter once, the token
    embedding as one row unless it is also the output projection (tied: read whole). With ``int8``, as
    ``quantize_int8`` stores it: each linear layer's and the output projection's weight as int8 rows with
    a float32 scale and an int32 sum per row (nn/quantize.py), the embedding then one float32 row."""
    embedding = model.decoder.embed.weight
    row = embedding[0].numel() * 4
    total = sum(p.numel() * p.element_size() for p in model.parameters()) - embedding.numel() * 4
    if int8:
        from atencion.nn.layers import Generator

        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, Generator)):
                n, k = m.weight.shape
                total -= 0 if m.weight is embedding else n * k * 4
                total += n * k + 8 * n
        return total + row
    return total + (embedding.numel() * 4 if model.generator.weight is embedding else row)


def gguf_step_bytes(path: Path) -> int:
    """The bytes a llama.cpp step reads from the GGUF file at ``path``: every tensor's, ``token_embd`` as one
    row unless the file has no ``output.weight`` (then the embedding is the output projection, read whole)."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}
    total = sum(int(t.n_bytes) for t in tensors.values())
    if "output.weight" in tensors:
        embedding = tensors["token_embd.weight"]
        total -= int(embedding.n_bytes) - int(embedding.n_bytes) // int(embedding.shape[-1])
    return total


def engine_bytes(ours, gguf_dir) -> dict:
    """Weight bytes per step of each precision's engines: float32 (atencion, Hugging Face, CTranslate2: the
    same weights), int8 (atencion's layout; Hugging Face's and CTranslate2's int8 store one byte per weight
    too, with scales per row or tensor), and llama.cpp's files where there are."""
    made = {"f32": step_bytes_of(ours), "int8": step_bytes_of(ours, int8=True)}
    for kind in LLAMA_CPP_PEERS if gguf_dir is not None else ():
        made[kind] = gguf_step_bytes(gguf_dir / f"model-{kind}.gguf")
    return made


WALL_ENGINES = {  # the wall table's engines: (its label, where its tokens/s is in a row, its bytes' precision)
    "atencion f32": (("ours_tok_s",), "f32"), "HF f32": (("hf_tok_s",), "f32"),
    "CT2 float32": (("ct2_float32", "tok_s"), "f32"), "llama.cpp f32": (("llamacpp_f32", "tok_s"), "f32"),
    "atencion int8": (("int8", "ours_tok_s"), "int8"), "HF int8": (("int8", "hf_tok_s"), "int8"),
    "CT2 int8": (("ct2_int8", "tok_s"), "int8"), "llama.cpp q8_0": (("llamacpp_q8_0", "tok_s"), "q8_0"),
}


def wall_rates(row: dict, rows: int, step_bytes: dict) -> dict:
    """Each engine of ``row`` measured: its weight bytes read per second (bytes per step × steps/s, a step making
    ``rows`` tokens) in GB/s; ``main`` adds each one's fraction of the read bandwidth."""
    made = {}
    for engine, (keys, kind) in WALL_ENGINES.items():
        value = row
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and kind in step_bytes:
            made[engine] = dict(gb_s=step_bytes[kind] * value / rows / 1e9, step_mb=step_bytes[kind] / 1e6)
    return made


# main --------------------------------------------------------------------------------------------

def run_size(size: str, args) -> dict:
    device = torch.device(args.device)
    result = {}
    if "train" in args.parts:
        result.update(training_part(size, args, device))
    if "decode" in args.parts:
        result.update(decoding_part(size, args, device))
    return result


def training_part(size: str, args, device: torch.device) -> dict:
    from atencion.tasks.loss import generator_loss, label_smoothed_loss

    hf, ours = build_models(size, dropout=0.1)
    hf, ours = hf.to(device), ours.to(device)
    steps = {"tiny": 12, "base": 3}[size] if args.quick else {"tiny": 40, "base": 15}[size]
    warmup = 1 if args.quick else 2
    if device.type == "cuda":
        steps *= 5
    if SMOKE:
        steps = 2
    batch_tokens = 512 if SMOKE else 4096
    batches = [b.to(device) for b in training_batches(multi30k_lengths(Path(args.data), "train"), batch_tokens,
                                                      steps + warmup)]
    result = {}
    ours.train()
    hf.train()
    speeds = train_tokens_per_second({
        # atencion as its trainer runs it; Hugging Face as its Seq2SeqTrainer would (logits, then the loss)
        "ours": (lambda b: generator_loss(ours(b.src, b.tgt_in, select=b.tgt_out != PAD, project=False),
                                          ours.generator.weight, ours.generator.bias, b.tgt_out, PAD, 0.1)[0],
                 ours.parameters()),
        "hf": (lambda b: label_smoothed_loss(hf(input_ids=b.src, attention_mask=b.src != PAD,
                                                decoder_input_ids=b.tgt_in).logits, b.tgt_out, PAD, 0.1)[0],
               hf.parameters()),
    }, batches, warmup, device, args.bf16)
    result["train_tok_s"], result["hf_train_tok_s"] = speeds["ours"], speeds["hf"]
    result["train_ratio_vs_hf"] = result["train_tok_s"] / result["hf_train_tok_s"]
    flops = training_flops(ours.cfg, batches[warmup:])
    tokens = sum(b.n_tokens for b in batches[warmup:])
    result["mfu"] = flops / (tokens / result["train_tok_s"]) / args.peak
    return result


def decoding_part(size: str, args, device: torch.device) -> dict:
    """Fresh copies with the same weights, in eval mode."""
    import tempfile

    result = {}
    hf, ours = build_models(size, dropout=0.1)
    hf, ours = hf.to(device).eval(), ours.to(device).eval()
    n = (100 if size == "tiny" else 40) if args.quick else (args.sentences if size == "tiny" else 100)
    if device.type == "cuda" or SMOKE:
        n = args.sentences
    srcs, batches = decode_batches(multi30k_lengths(Path(args.data), "val"), n, args.batch_sentences)
    batches = [(rows, ids.to(device)) for rows, ids in batches]
    max_len = args.max_len
    decoders = {"ours": atencion_decoder(ours, batches, n, args.beam, args.alpha, max_len),
                "hf": hf_decoder(hf, batches, n, args.beam, args.alpha, max_len)}
    if device.type == "cpu":
        from atencion.nn.quantize import quantize_int8

        decoders["int8"] = atencion_decoder(quantize_int8(ours), batches, n, args.beam, args.alpha, max_len)
    ct2 = device.type == "cpu" and installed("ctranslate2", "CTranslate2's rows")  # CTranslate2: CPU only
    with tempfile.TemporaryDirectory() as tmp:
        if ct2:
            from atencion.export import export

            export(ours, Path(tmp) / "ct2", "ctranslate2")
            for compute_type in ("float32", "int8"):
                decoders[f"ct2_{compute_type}"] = ct2_decoder(Path(tmp) / "ct2", srcs, batches, n, args.beam,
                                                              args.alpha, max_len, compute_type)
        out, s = time_decoders(decoders, batches, args.rounds)
    result.update(sentences=n, decode_sent_s=n / s["ours"], decode_tok_s=sum(map(len, out["ours"])) / s["ours"],
                  hf_decode_sent_s=n / s["hf"], decode_ratio_vs_hf=s["hf"] / s["ours"],
                  agreement_hf=agreement(out["ours"], out["hf"]))
    if "int8" in s:
        result.update(int8_decode_sent_s=n / s["int8"], int8_decode_ratio_vs_hf=s["hf"] / s["int8"],
                      agreement_int8_vs_fp32=agreement(out["int8"], out["ours"]))
    if not ct2:
        result["ct2_decode_sent_s"] = None
    else:
        result.update(ct2_decode_sent_s=n / s["ct2_float32"], ct2_int8_decode_sent_s=n / s["ct2_int8"],
                      decode_ratio_vs_ct2=s["ct2_float32"] / s["ours"],
                      agreement=agreement(out["ours"], out["ct2_float32"]),
                      agreement_ct2_int8=agreement(out["ours"], out["ct2_int8"]))
        if "int8" in s:
            result["int8_decode_ratio_vs_ct2_int8"] = s["ct2_int8"] / s["int8"]
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--quick", action="store_true", help="fewer steps and sentences (under 4 minutes)")
    parser.add_argument("--sizes", default="tiny,base", help="comma-separated: tiny, base (default: both)")
    parser.add_argument("--data", default=str(DATA / "multi30k"))
    parser.add_argument("--parts", default="train,decode,lm,llama",
                        help="comma-separated: train, decode (translation, at --sizes), lm (GPT and BERT), llama "
                             "(a Llama-style decoder's generation), llama-1b (batch 1 at TinyLlama-1.1B's shape, "
                             "4.4 GB of float32 weights; not in the default) (default: train,decode,lm,llama)")
    parser.add_argument("--sentences", type=int, default=500, help="decoded sentences at tiny size (default: 500)")
    parser.add_argument("--batch-sentences", type=int, default=64,
                        help="sentences per decoding batch, the same batches for every engine (default: 64)")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--max-len", type=int, default=24, help="maximum output length, all engines")
    parser.add_argument("--rounds", type=int, default=0,
                        help="decoding rounds per engine, interleaved; each engine's fastest counts "
                             "(default: 2 with --quick, else 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu; CTranslate2 runs on cpu only)")
    parser.add_argument("--bf16", action="store_true", help="train under bf16 autocast (for GPUs)")
    parser.add_argument("--smoke", action="store_true", help=SMOKE_HELP + "; here every part, the tiny size, "
                        "shapes and steps made tiny")
    args = parser.parse_args(argv)
    if args.smoke:
        smoke_settings()
        args.quick, args.sizes, args.sentences, args.batch_sentences = True, "tiny", 8, 8
        args.max_len, args.rounds, args.threads = 4, 1, args.threads or 1
        if args.parts == parser.get_default("parts"):  # every part, the llama-1b one too
            args.parts += ",llama-1b"
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.parts = args.parts.split(",")
    for name, given, known in (("--parts", args.parts, ("train", "decode", "lm", "llama", "llama-1b")),
                               ("--sizes", args.sizes.split(","), SIZES)):
        if not given or not set(given) <= set(known):
            parser.error(f"{name} takes a comma-separated list of {', '.join(known)}; got {','.join(given)!r}")
    keep_freed_memory()  # as the atencion commands do; process-wide, so every engine here gets it
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    args.peak = matmul_peak_flops(device, torch.bfloat16 if args.bf16 else torch.float32,
                                  **(dict(n=256, repeats=2) if SMOKE else {}))
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "vector_width": bandwidth.vector_width(), "bf16": args.bf16, "threads": torch.get_num_threads(),
              "peak_gflops": args.peak / 1e9, "torch": torch.__version__}
    walls = []  # the llama rows' wall: the read bandwidth measured before and after them
    if {"llama", "llama-1b"} & set(args.parts):
        walls.append(bandwidth.measure(**(dict(gib=1 / 64, rounds=2) if SMOKE else {})))
    if {"train", "decode"} & set(args.parts):
        for size in args.sizes.split(","):
            report[size] = run_size(size, args)
    if {"lm", "llama", "llama-1b"} & set(args.parts):
        report["lm"] = lm_parts(args, device)
    if walls:
        walls.append(bandwidth.measure(**(dict(gib=1 / 64, rounds=2) if SMOKE else {})))
        take_wall(report, walls)
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return report


def lm_parts(args, device: torch.device) -> dict:
    """The rows of the lm, llama and llama-1b parts that ``args.parts`` names."""
    import transformers

    transformers.logging.set_verbosity_error()  # generate's advice on attention masks, not a result
    rows = lm_part(args, device) if "lm" in args.parts else {}
    if "llama" in args.parts:
        rows.update(llama_part(args, device))
    if "llama-1b" in args.parts:
        gc.collect()  # the llama part's models, before 4.4 GB of weights
        rows.update(llama_1b_part(args, device))
    return rows


def take_wall(report: dict, walls: list[dict]) -> None:
    """The read bandwidth measured before and after the llama rows, the larger of them kept as the wall (so that
    no fraction is flattered by a slow moment), and every engine's fraction of it."""
    report["bandwidth"] = max(walls, key=lambda wall: wall["read"])
    report["bandwidth_before_after"] = [wall["read"] for wall in walls]
    for row in report["lm"].values():
        for engine in row.get("wall", {}).values():
            engine["fraction"] = engine["gb_s"] / report["bandwidth"]["read"]


def print_table(report: dict) -> None:
    precision = "bf16" if report["bf16"] else "fp32"
    print(f"{report['device']} ({report['vector_width']}), threads {report['threads']}, {precision} matmul peak "
          f"{report['peak_gflops']:.0f} GFLOP/s, torch {report['torch']}")
    if "bandwidth" in report:
        before, after = report["bandwidth_before_after"]
        print(f"{bandwidth.describe(report['bandwidth'])}; before the llama rows {before:.1f}, after {after:.1f}: "
              "the larger is the wall")
    sizes = [s for s in SIZES if s in report]
    if sizes:
        keys = [k for k in report[sizes[0]]]
        print(f"{'':<24}" + "".join(f"{s:>14}" for s in sizes))
        for key in keys:
            cells = []
            for s in sizes:
                value = report[s].get(key)
                cells.append(f"{'-' if value is None else (f'{value:.3f}' if abs(value) < 10 else f'{value:.0f}'):>14}")
            print(f"{key:<24}" + "".join(cells))
    if "lm" in report:
        alone = {name: row for name, row in report["lm"].items() if "hf_tok_s" not in row}  # llama-1b: no peer
        if len(alone) < len(report["lm"]):
            print_lm_table({name: row for name, row in report["lm"].items() if name not in alone})
        print_alone(alone)
        print_walls({name: row["wall"] for name, row in report["lm"].items() if "wall" in row})


def print_alone(rows: dict) -> None:
    """The llama-1b part's row: atencion's tokens/s, and against llama.cpp's where it ran."""
    for name, row in rows.items():
        line = f"\n{name} ({row['shape']}): atencion float32 {row['ours_tok_s']:.1f} tokens/s"
        for kind, label in (("f32", "float32"), ("q8_0", "int8")):
            peer = row.get(f"llamacpp_{kind}")
            if peer is not None:
                line += (f"; {label} {peer['ours_tok_s']:.1f} / llama.cpp {kind} {peer['tok_s']:.1f}, ratio "
                         f"{peer['ratio']:.2f} ({peer['ratio_min']:.2f}-{peer['ratio_max']:.2f}), greedy same "
                         f"{peer['greedy_same']:.3f}")
                if "margin_there" in peer:
                    line += (f" (first differs at new token {peer['first_difference_at']}, where atencion's top two "
                             f"logits are {peer['margin_there']:.2g} apart)")
        print(line)


def print_walls(walls: dict) -> None:
    """Each engine's weight bytes read per second, and that as a fraction of the measured read bandwidth."""
    if not walls:
        return
    print(f"\n{'at the memory wall':<24}{'engine':>16}{'MB/step':>9}{'GB/s':>8}{'of wall':>9}")
    for name, engines in walls.items():
        for engine, wall in engines.items():
            print(f"{name:<24}{engine:>16}{wall['step_mb']:>9.0f}{wall['gb_s']:>8.1f}{wall['fraction']:>9.2f}")
    print("  GB/s: weight bytes read per step (MB/step: every weight once, the embedding one row unless tied) x "
          "steps/s; of wall: over the read bandwidth above")


def print_lm_table(rows: dict) -> None:
    """The lm part: a row per measurement, then the shape of each and any greedy mismatch."""
    print(f"\n{'lm (tokens/s)':<24}{'atencion':>12}{'HF':>12}{'ratio':>8}{'range':>14}{'greedy same':>13}")
    for name, row in rows.items():
        same = row.get("greedy_same")
        print(f"{name:<24}{row['ours_tok_s']:>12.0f}{row['hf_tok_s']:>12.0f}{row['ratio']:>8.2f}"
              f"{row['ratio_min']:>8.2f}-{row['ratio_max']:<5.2f}{'' if same is None else f'{same:.3f}':>13}")
    for name, row in rows.items():
        print(f"  {name}: {row['shape']}")
    for name, row in rows.items():
        if row.get("greedy_same", 1.0) < 1.0:
            print(f"  MISMATCH {name}: greedy tokens differ from Hugging Face's in {1 - row['greedy_same']:.0%} "
                  f"of the rows, first at new token {row['first_difference_at']}")
    ct2 = {name: row for name, row in rows.items() if "ct2_float32" in row}
    if ct2:
        print(f"\n{'CTranslate2 (tokens/s)':<24}{'atencion':>12}{'CT2':>12}{'ratio':>8}{'range':>14}"
              f"{'greedy same':>13}")
        for name, row in ct2.items():
            for kind in ("float32", "int8"):
                peer = row[f"ct2_{kind}"]
                print(f"{name + ' ' + kind:<24}{row['ours_tok_s']:>12.0f}{peer['tok_s']:>12.0f}{peer['ratio']:>8.2f}"
                      f"{peer['ratio_min']:>8.2f}-{peer['ratio_max']:<5.2f}{peer['greedy_same']:>13.3f}")
        print("  ratio: atencion's tokens/s (float32) over CTranslate2's; int8's greedy tokens may differ from "
              "float32's")
    llama = {f"{name} {kind}": row[f"llamacpp_{kind}"] for name, row in rows.items() for kind in LLAMA_CPP_PEERS
             if f"llamacpp_{kind}" in row}
    if llama:
        print(f"\n{'llama.cpp (tokens/s)':<24}{'atencion':>12}{'llama.cpp':>12}{'ratio':>8}{'range':>14}"
              f"{'greedy same':>13}")
        for name, peer in llama.items():
            print(f"{name:<24}{peer['ours_tok_s']:>12.0f}{peer['tok_s']:>12.0f}{peer['ratio']:>8.2f}"
                  f"{peer['ratio_min']:>8.2f}-{peer['ratio_max']:<5.2f}{peer['greedy_same']:>13.3f}")
        print("  llama.cpp on atencion's GGUF export, each row a sequence of one batch: f32 against atencion's "
              "float32, q8_0 against its quantize_int8 (their greedy tokens may differ)")
    int8 = {name: row["int8"] for name, row in rows.items() if "int8" in row}
    if int8:
        print(f"\n{'int8 (tokens/s)':<24}{'atencion':>12}{'HF':>12}{'ratio':>8}{'range':>14}{'greedy same':>13}"
              f"{'as fp32':>9}")
        for name, row in int8.items():
            print(f"{name:<24}{row['ours_tok_s']:>12.0f}{row['hf_tok_s']:>12.0f}{row['ratio']:>8.2f}"
                  f"{row['ratio_min']:>8.2f}-{row['ratio_max']:<5.2f}{row['greedy_same']:>13.3f}"
                  f"{row['same_as_float32']:>9.3f}")
        print("  atencion's quantize_int8 against torch's quantize_dynamic of the Hugging Face model; greedy same: "
              "their rows agree; as fp32: atencion's int8 rows equal its float32 rows")


if __name__ == "__main__":
    sys.exit(main() and 0)
