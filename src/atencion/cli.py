"""The `atencion` command line: thin argument parsing over library functions. The commands below
are the general ones; each task adds its own (translate, generate, fill-mask, classify, transcribe:
its ``TaskSpec.command``, tasks/), read from ``TASKS`` when the parser is built."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import re
import sys
from pathlib import Path

from .allocator import keep_freed_memory
from .arguments import (
    COUNT,
    DRAFT_TOKENS,
    NON_NEGATIVE,
    POSITIVE,
    TTA_SHIFT_HELP,
    Command,
    add_decoding_arguments,
    bounded,
    decode_config_of,
    draft_tokens_of,
    warner,
)
from .chat import add_chat_arguments, cmd_chat  # (torch is imported when it runs)
from .errors import AtencionError, Interrupted
from .interrupt import remembering_ctrl_c
from .kernels_cli import add_kernels_arguments, cmd_kernels  # (torch is imported when it runs)
from .torchrun import say


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage is one --help away)."""

    def error(self, message: str):
        text = f"{message} (see {self.prog} --help)"
        say(f"{self.prog}: error: {text}", 2, text)  # once under torchrun (torchrun.py)
        self.exit(2)


# the general commands: each one's arguments, then what runs it --------------------------------------

def add_presets_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=bounded(int, 5, highest=1_000_000), default=37000,
                   help="vocabulary for base/big (default: 37000, the paper's)")
    p.add_argument("--tiny-vocab", type=bounded(int, 5, highest=1_000_000), default=10000,
                   help="vocabulary for tiny, gpt-tiny and t5-tiny, at most 1,000,000 (default: 10000); "
                        "bert-*, gpt2 and t5-small take their published vocabularies")


def cmd_presets(args: argparse.Namespace) -> None:
    """Build a tiny model, run it on an example batch, and list every preset's shape and parameter
    count, beside the count its paper publishes (the paper's vocabulary)."""
    from .viz.presets import presets_report

    sys.stdout.write(presets_report(args.vocab, args.tiny_vocab))


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="output directory, new or empty (default: runs/demo-DATE-TIME)")
    p.add_argument("--config", help="training config (default: configs/toy_es_en.yaml)")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--seed", type=COUNT, default=0, help="seed of the generated corpus (default: 0)")
    p.add_argument("--train-size", type=bounded(int, 10, highest=1_000_000), default=30000,
                   help="generated training pairs, 10 to 1,000,000 (default: 30000)")
    p.add_argument("--test-size", type=bounded(int, 1, highest=100_000), default=500,
                   help="held-out test pairs, 1 to 100,000 (default: 500)")


def cmd_demo(args: argparse.Namespace) -> None:
    """Generate a Spanish→English corpus from the project's own grammar, train a tiny model on it
    (a few minutes on a laptop CPU), translate examples; the last line is a JSON summary."""
    import time

    from .demo.run import format_examples, run_demo

    summary = run_demo(args.out or time.strftime("runs/demo-%Y%m%d-%H%M%S"), args.config, args.set or [],
                       n_train=args.train_size, n_test=args.test_size, seed=args.seed, warn=warner("demo"))
    sys.stdout.write(format_examples(summary.pop("examples")))
    print(json.dumps(summary))


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config file")
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=100 or --set task=lm (repeatable)")
    p.add_argument("--out", default="runs/train", help="output directory (default: runs/train)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")


def cmd_train(args: argparse.Namespace) -> None:
    """Train a model from a YAML config (see configs/reference.yaml): its task: is translate (an
    encoder-decoder on parallel text), lm (a GPT on plain text), mlm (a BERT by masking),
    classify (a label per sentence, label<TAB>text, or per file, label<TAB>path) or transcribe
    (speech to text, text<TAB>path.wav)."""
    from .train.trainer import train_file

    print(json.dumps(train_file(args.config, args.out, args.set or [], args.resume)))


def add_evaluate_arguments(p: argparse.ArgumentParser) -> None:
    add_decoding_arguments(p)
    p.add_argument("--src", help="translator: source sentences, one a line")
    p.add_argument("--ref", help="translator: reference translations, aligned with --src")
    p.add_argument("--output", help="translator: also write the translations to this file (and, with --raw-ref, "
                                    "the detokenized ones to OUTPUT.detok)")
    p.add_argument("--raw-ref", help="translator: raw references (cased, untokenized), aligned with --src: score "
                                     "the detokenized output against them with sacreBLEU (needs sacremoses)")
    p.add_argument("--recase-from", help="translator: raw text in the target language (e.g. the raw training "
                                         "targets) to learn each word's casing from, to recase the output")
    p.add_argument("--lang", help="translator: target language for detokenizing (default: from --raw-ref's name, "
                                  "e.g. test.de.gz)")
    p.add_argument("--text", help="language model: a text, read as one stream with its line breaks; masked "
                                  "language model: sentences, one a line")
    p.add_argument("--block-size", type=POSITIVE,
                   help="language model: tokens per block, each block read on its own (default: the model's "
                        "max_positions)")
    p.add_argument("--tsv", help="classifier: label<TAB>text rows (a first line whose label is no label of the "
                                 "model is a header, as in training); speech-to-text model: text<TAB>path.wav rows "
                                 "(paths relative to the TSV's folder); towers (task contrastive): the first "
                                 "tower's label<TAB>path test rows")
    p.add_argument("--tta-shift", type=bounded(int, 0, highest=4), metavar="N", help=TTA_SHIFT_HELP)
    p.add_argument("--other-tsv", help="towers: the second tower's label<TAB>path test rows (retrieval both ways)")
    p.add_argument("--centroid-tsv", help="towers: the second tower's labelled rows whose mean embedding per label "
                                          "classifies the first tower's items zero-shot (e.g. its training rows)")


def cmd_evaluate(args: argparse.Namespace) -> None:
    """Score a model on a test set; prints one JSON object with "task", the scores and the settings.
    What it reads depends on the task the model was trained for (its config.json, tasks/):
    a translator translates --src and scores it against --ref: bleu, bleu_tok, chrf; with --raw-ref,
    for models trained on tokenized lower-cased text, also raw_bleu_lc, and with --recase-from
    raw_bleu and raw_chrf (sacreBLEU on the recased, detokenized output).
    A language model (task lm) reads --text: loss (nats per token), ppl and bpc (bits per character),
    in non-overlapping blocks of --block-size tokens.
    A masked language model (task mlm) reads --text, one sentence a line: loss, ppl and accuracy on
    15% of the tokens, masked as in training from a fixed seed, beside most_frequent_token_accuracy,
    that of always guessing the most frequent token of --text itself (a baseline that has seen the
    test text's counts).
    A classifier (task classify) reads --tsv: accuracy, loss and the confusion matrix (rows: true
    label, columns: predicted, in the order of "labels"); an image classifier with --tta-shift N
    averages over the shifted images (and says "tta_shift").
    A speech-to-text model (task transcribe) reads --tsv, text<TAB>path.wav rows: it transcribes
    the recordings (--beam, --alpha, ... as for a translator) and gives exact_match, bleu, bleu_tok
    and chrf against the texts.
    Towers (task contrastive) read --tsv (the first tower's test files), --other-tsv (the second's)
    and --centroid-tsv: zero_shot_accuracy (nearest label centroid of --centroid-tsv), Recall@1
    both ways (an item of the same label counts), each beside its chance.
    An option for another kind of model is refused."""
    from .tasks import evaluate

    options = {name: value for name, value in vars(args).items() if name not in ("command", "func", "verbose")}
    result = evaluate(decode=decode_config_of(args), warn=warner("evaluate"), **options)
    print(json.dumps(result, ensure_ascii=result["task"] == "translate"))


def add_download_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", choices=["multi30k"], help="which dataset")
    p.add_argument("--out", default="data/multi30k", help="output directory (default: data/multi30k)")
    p.add_argument("--base-url", help="repository URL to fetch from (default: the multi30k/dataset GitHub repository)")


def cmd_download(args: argparse.Namespace) -> None:
    """Download a public dataset (Multi30k task 1: raw/ and tok/ files, train/val/test2016)."""
    from .data.download import MULTI30K_URL, download_multi30k

    written = download_multi30k(args.out, args.base_url or MULTI30K_URL)
    print(json.dumps({"dataset": args.dataset, "out": args.out, "files_written": len(written)}))


def add_attention_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory: a translator, a GPT (arch decoder), a BERT "
                                                   "(arch encoder), a ViT or a speech model")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--src", "--text", dest="src", metavar="TEXT",
                       help="the sentence: a translator's source, a GPT's text (its prompt), a BERT's sentence")
    given.add_argument("--image", help="a ViT's image (PNG or NPY): its [CLS] attention and rollout over the patches")
    given.add_argument("--audio", help="a speech model's WAV file: a classifier's pooled attention over the frames, a "
                                       "speech-to-text model's cross-attention for each character it writes")
    p.add_argument("--tgt", help="translator only: target sentence, teacher-forced (default: the model's own "
                                 "translation)")
    p.add_argument("--out", required=True, help="output directory (files of the same names are replaced)")
    p.add_argument("--words", action="store_true",
                   help="aggregate subword pieces into words: mean over a word's query rows, sum over its key columns")
    p.add_argument("--shift", choices=["predict", "input"],
                   help="translator only: cross-attention row for target piece j: 'predict', row j, whose output "
                        "predicts it (default); 'input', row j+1, where it is the decoder's input")
    p.add_argument("--beam", type=bounded(int, 1, highest=64),
                   help="translator only: beam size when translating (default: 4)")
    p.add_argument("--max-new-tokens", type=COUNT, default=0,
                   help="GPT only: tokens to generate greedily after --text, shown with it (default: 0)")
    p.add_argument("--max-tokens", type=bounded(int, 1, highest=512), default=128,
                   help="most tokens, at most 512: a translator's subword pieces on either side, a GPT's text + "
                        "new tokens, a BERT's <s> sentence </s> (default: 128; the maps grow with the square of "
                        "the length), checked before any work")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")


def cmd_attention(args: argparse.Namespace) -> None:
    """Write every attention map of one sentence pair into --out: encoder.png, decoder.png,
    cross.png (layers × heads), cross_mean.png, bertviz.json and attention.html. Without --tgt
    the model translates --src first (beam search) and its output is the target. A GPT or a
    BERT has self-attention only: decoder.png (GPT, causal, over --text and the
    --max-new-tokens it generates greedily) or encoder.png (BERT, over <s> --text </s>), its
    KIND_mean.png, bertviz.json and attention.html. With --image (a ViT) or --audio (a speech
    model): attention.png and attention.json, the attention over the patches or the frames."""
    from .viz.attention import CAUTION
    from .viz.report import attention_report

    summary = attention_report(args.model, args.src, args.out, args.tgt, args.words, args.shift, args.beam,
                               args.max_new_tokens, args.max_tokens, args.device, args.image, args.audio)
    print(f"note: {CAUTION}", file=sys.stderr)
    print(json.dumps(summary, ensure_ascii=False))


def add_aer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--src", required=True, help="source sentences, one a line")
    p.add_argument("--tgt", required=True, help="target sentences (teacher-forced), aligned with --src")
    p.add_argument("--align", required=True, help="gold alignments, Pharaoh 'i-j' (source i, target j; 'i?j' possible)")
    p.add_argument("--max-sentences", type=COUNT, default=0, help="use the first N sentences (default: all)")
    p.add_argument("--max-tokens", type=POSITIVE, default=1024,
                   help="a sentence of more subword pieces on either side is refused before any work (default: 1024)")
    p.add_argument("--shift", choices=["predict", "input"], default="predict",
                   help="cross-attention row for target word j: 'predict' (row j, default) or 'input' (row j+1)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")


def cmd_aer(args: argparse.Namespace) -> None:
    """Alignment error rate of cross-attention: teacher-force each gold target (no decoding), link
    every target word to the source word it attends to most (per layer with heads averaged, and
    all layers averaged), score against --align; prints a markdown table, then one JSON line."""
    from .viz.attention import CAUTION, format_aer_table
    from .viz.report import aer_report

    result = aer_report(args.model, args.src, args.tgt, args.align, args.shift, args.max_sentences, args.max_tokens,
                        args.device)
    print(f"note: {CAUTION}", file=sys.stderr)
    print(format_aer_table(result))
    print(json.dumps(result))


def add_induction_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory (a decoder: arch decoder)")
    p.add_argument("--length", type=POSITIVE,
                   help="random tokens before they repeat, read twice (default: 100, or as many as the model's "
                        "positions and vocabulary take when fewer)")
    p.add_argument("--rows", type=POSITIVE, default=8, help="repeated sequences scored (default: 8)")
    p.add_argument("--seed", type=COUNT, default=0, help="of the random tokens (default: 0)")
    p.add_argument("--text", help="held-out text: also the in-context learning score (loss at token 500 minus 50)")
    p.add_argument("--context", type=POSITIVE, default=512, help="tokens per row of --text (default: 512)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")


def cmd_induction(args: argparse.Namespace) -> None:
    """Induction heads (Olsson et al. 2022): every head's prefix-matching and copying score on
    repeated random tokens, and with --text the in-context learning score; one JSON object."""
    from .viz.induction import induction_report

    print(json.dumps(induction_report(args.model, args.length, args.rows, args.seed, args.text, args.context,
                                      args.device)))


def add_figures_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (files in it with the same names are replaced)")
    p.add_argument("--quick", action="store_true", help="Table 1 for n ≤ 512 and fewer samples (well under a minute)")


def cmd_figures(args: argparse.Namespace) -> None:
    """Compute the course's figures and tables on this machine: sinusoidal positions, maximum path
    lengths, Table 1 measured (time and memory per layer), and why attention divides by √d_k."""
    from .viz.figures import FigureSettings, summary, write_figures

    print(summary(write_figures(args.out, FigureSettings.quick() if args.quick else FigureSettings.full())))


def add_export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--format", required=True, choices=["ctranslate2", "hf", "onnx", "gguf"], help="what to write")
    p.add_argument("--out", required=True, help="output directory, new or empty")
    p.add_argument("--dtype", choices=["float32", "float16", "q8_0"], default=None,
                   help="gguf only: the weights' type (default float32; norms and biases stay float32)")


def cmd_export(args: argparse.Namespace) -> None:
    """Export a model directory for another runtime: ctranslate2 (CTranslate2 model), hf (Hugging
    Face MarianMTModel), onnx (encoder + one decoder step) or gguf (llama.cpp, decoder-only
    models). --out must be new or empty."""
    from .export import export_model_dir

    files = export_model_dir(args.model, args.out, args.format, args.dtype)
    print(json.dumps({"format": args.format, "out": args.out, "files": files}))


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", required=True, metavar="[NAME=]DIR",
                   help="a model directory, optionally named (repeatable; the first is the default)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=bounded(int, 0, highest=65535), default=8000, help="port (default: 8000)")
    p.add_argument("--batch-tokens", type=POSITIVE, default=4096,
                   help="source tokens decoded together at most (default: 4096)")
    p.add_argument("--max-wait-ms", type=NON_NEGATIVE, default=5.0,
                   help="how long a request waits for others to share its batch (default: 5)")
    p.add_argument("--max-sentences", type=POSITIVE, default=64, help="sentences per request (default: 64)")
    p.add_argument("--max-tokens", type=POSITIVE, default=256,
                   help="subword pieces per sentence, prompt or text to fill (default: 256)")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=512,
                   help="tokens generated per sample by /generate (default: 512)")
    p.add_argument("--max-samples", type=POSITIVE, default=16, help="samples per /generate request (default: 16)")
    p.add_argument("--max-sequences", type=POSITIVE, default=32,
                   help="continuous batching: sequences a decoder's /v1 requests decode together, each joining at the "
                        "next step and leaving when done; 1 decodes one at a time (default: 32)")
    p.add_argument("--max-tokens-in-flight", type=POSITIVE, default=32768,
                   help="continuous batching: prompt and new tokens of the sequences decoded together; a request "
                        "waits until it fits (default: 32768)")
    p.add_argument("--max-body-bytes", type=POSITIVE, default=1 << 20,
                   help="request body size; larger is answered 413 (default: 1 MiB)")
    p.add_argument("--max-queue", type=POSITIVE, default=256,
                   help="requests waiting per model; more are answered 429 with Retry-After (default: 256)")
    p.add_argument("--timeout", type=bounded(float, 0.0, inclusive=False, highest=3600), default=60.0,
                   help="seconds per request, waiting included; then 504 (default: 60)")
    p.add_argument("--read-timeout", type=bounded(float, 0.0, inclusive=False, highest=3600), default=10.0,
                   help="seconds for a client to send a request's headers, and its body (then 408), and for an "
                        "idle connection to stay open; a stalled client is disconnected (default: 10)")
    p.add_argument("--api-key", help="require this key (header X-API-Key or Authorization: Bearer) on every "
                                     "endpoint but /health (default: $ATENCION_API_KEY, else none)")
    p.add_argument("--draft", metavar="DIR",
                   help="speculative decoding for /generate: a small model directory with the same tokenizer as "
                        "each served decoder proposes tokens that the decoder verifies; the same text (greedy) or "
                        "distribution (sampled) as without it; translators and encoders are served without it "
                        "(default: off)")
    p.add_argument("--draft-tokens", type=bounded(int, 1, highest=64),
                   help=f"with --draft: tokens the draft proposes per round (default: {DRAFT_TOKENS})")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")
    p.add_argument("--threads", type=COUNT, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--int8", action="store_true",
                   help="decode with int8 linear layers (dynamic quantization; CPU only; faster, slightly less "
                        "accurate), every model served and its draft")


def cmd_serve(args: argparse.Namespace) -> None:
    """Serve models over HTTP: POST /translate (batched with the requests that arrive with it),
    /generate, /fill-mask and /classify (language models, one request at a time per model), GET
    /info, /health, /metrics (Prometheus), and the attention explorer at /. Stops on Ctrl-C or
    SIGTERM after answering the requests in flight. With --draft, /generate decodes speculatively
    (one text at a time) for the decoders served."""
    from .serve.run import serve_dirs

    draft_tokens = draft_tokens_of(args)  # before any model is read
    serve_dirs(args.model, args.host, args.port, args.device, args.threads, args.draft, draft_tokens or DRAFT_TOKENS,
               args.int8,
               batch_tokens=args.batch_tokens, max_wait_ms=args.max_wait_ms, max_sentences=args.max_sentences,
               max_tokens=args.max_tokens, max_new_tokens=args.max_new_tokens, max_samples=args.max_samples,
               max_sequences=args.max_sequences, max_tokens_in_flight=args.max_tokens_in_flight,
               max_body_bytes=args.max_body_bytes, max_queue=args.max_queue, timeout_s=args.timeout,
               read_timeout_s=args.read_timeout, api_key=args.api_key)


def add_average_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoint directories")


def cmd_average(args: argparse.Namespace) -> None:
    """Average the weights of checkpoints (model directories) into a new model directory."""
    from .train.checkpoint import average_checkpoints

    average_checkpoints(args.checkpoints, args.out, force=args.force)
    print(json.dumps({"averaged": len(args.checkpoints), "out": str(args.out)}))


def add_import_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="a Hugging Face model directory (config.json with model_type, "
                                                    "model.safetensors or its shards, the tokenizer's files)")
    p.add_argument("--out", required=True, help="output model directory, new or empty")


def cmd_import(args: argparse.Namespace) -> None:
    """Convert a Hugging Face model directory once into an atencion model directory: its weights
    under atencion's names, in the dtype they were stored in, and its tokenizer's files as they
    were. Every command also takes the Hugging Face directory itself, converting it on load."""
    from .nn.model_dir import import_dir

    print(json.dumps(import_dir(args.directory, args.out)))


def add_tokenize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="+", metavar="TEXT", help="plain-text files (or .gz), read in this order")
    p.add_argument("--tokenizer", required=True, help="a directory with the tokenizer: a model's, a training "
                                                      "run's, or a Hugging Face tokenizer's (tokenizer.json)")
    p.add_argument("--out", required=True, help="the token file to write (new; nothing is overwritten)")


def cmd_tokenize(args: argparse.Namespace) -> None:
    """Tokenize text once into a token file (uint16/uint32 ids after a JSON header) that
    ``task: lm`` reads memory-mapped through data.train_tokens."""
    from .tasks.lm import tokenize_files

    print(json.dumps(tokenize_files(args.tokenizer, args.texts, args.out)))


def add_merge_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a LoRA model directory (adapters over a base model)")
    p.add_argument("--out", required=True, help="output model directory, new or empty")


def cmd_merge_lora(args: argparse.Namespace) -> None:
    """Fold a LoRA model's adapters into its base weights (W + α/r · B A): a plain model directory
    that needs no base, decodes as fast as any model, and exports."""
    from .nn.model_dir import merge_lora_dir

    parameters = merge_lora_dir(args.model, args.out)
    print(json.dumps({"merged": str(Path(args.model)), "out": str(Path(args.out)), "parameters": parameters}))


# (name, help, its arguments, the function that runs it), in the order of `atencion --help`
COMMANDS = [
    ("presets", "run a tiny model on an example batch; list preset sizes", add_presets_arguments, cmd_presets),
    ("demo", "train the embedded Spanish→English model and translate examples", add_demo_arguments, cmd_demo),
    ("train", "train a model: a translator, a GPT, a BERT, a classifier or a speech-to-text model",
     add_train_arguments, cmd_train),
    ("evaluate", "score a model on a test set (BLEU, perplexity, masked-token or label accuracy)",
     add_evaluate_arguments, cmd_evaluate),
    ("download", "download a public dataset (multi30k)", add_download_arguments, cmd_download),
    ("attention", "plot every attention map of one sentence pair (or of a GPT's or a BERT's text)",
     add_attention_arguments, cmd_attention),
    ("aer", "alignment error rate of cross-attention against gold alignments", add_aer_arguments, cmd_aer),
    ("induction", "induction heads: prefix-matching and copying scores per head, the in-context learning score",
     add_induction_arguments, cmd_induction),
    ("figures", "the course's figures and Table 1, measured here", add_figures_arguments, cmd_figures),
    ("export", "export a model to ctranslate2, hf (Marian), onnx or gguf", add_export_arguments, cmd_export),
    ("serve", "serve models over HTTP, with the attention explorer page", add_serve_arguments, cmd_serve),
    ("chat", "chat with an instruct model in the terminal, through its chat template", add_chat_arguments, cmd_chat),
    ("average", "average checkpoints", add_average_arguments, cmd_average),
    ("merge-lora", "fold a LoRA model's adapters into plain weights", add_merge_lora_arguments, cmd_merge_lora),
    ("kernels", "the CPU decoding kernels: build them, show what is used, benchmark them against F.linear",
     add_kernels_arguments, cmd_kernels),
    ("import", "convert a Hugging Face model directory into an atencion one", add_import_arguments, cmd_import),
    ("tokenize", "write text as a token file for data.train_tokens (task lm)", add_tokenize_arguments,
     cmd_tokenize),
]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command: the general ones (``COMMANDS``), each task's after train (its
    ``TaskSpec.command``, in the order tasks/ registers them). Reading the tasks loads torch."""
    from .tasks import TASKS

    parser = _Parser(
        prog="atencion",
        description="The Transformer of 'Attention Is All You Need': train, decode, score, inspect.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    general = [Command(*entry) for entry in COMMANDS]
    tasks = [spec.command for spec in TASKS.values() if spec.command is not None]
    after_train = next(i for i, command in enumerate(general) if command.name == "train") + 1
    for command in [*general[:after_train], *tasks, *general[after_train:]]:
        p = sub.add_parser(command.name, help=command.help, description=command.run.__doc__)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    name = "atencion " + next((word for word in argv if not word.startswith("-")), "").strip()
    try:
        with remembering_ctrl_c():  # a Ctrl-C that something swallows still stops the command
            with remembering_ctrl_c(defer=True):  # not cut in the middle of a C extension's loading (interrupt.py)
                import numpy  # noqa: F401  (every command needs them; a Ctrl-C here becomes "interrupted")
                import torch  # noqa: F401
                parser = build_parser()  # the tasks' commands: their modules load torch
            args = parser.parse_args(argv)
            logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                                format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
            keep_freed_memory()  # see allocator.py: large tensors are reused instead of faulted in again
            name = f"atencion {args.command}"
            args.func(args)
    except Interrupted as err:
        return _fail(name, err, 130)
    except KeyboardInterrupt:
        return _fail(name, "interrupted", 130)
    except AtencionError as err:
        return _fail(name, err, 2)
    except BrokenPipeError:  # the reader of stdout went away (e.g. `| head`): not an error of ours
        sys.stderr.close()
        return 141
    except OSError as err:
        if err.errno not in KNOWN_OS_ERRORS:
            raise  # a bug to report, with its traceback
        where = f"{err.filename}: " if err.filename else ""
        return _fail(name, f"{where}{err.strerror}", 2)
    return 0


# Faults of the machine rather than of the program: a full disk, no permission, a read-only place.
KNOWN_OS_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG,
                   errno.ENAMETOOLONG, errno.EISDIR, errno.ENOTDIR, errno.EIO, errno.ENOMEM}


def _fail(name: str, message, status: int) -> int:
    text = re.sub(r"\s*\n\s*", " ", str(message)).strip()
    say(f"{name}: {'error: ' if status == 2 else ''}{text}", status, text)  # once under torchrun (torchrun.py)
    return status


if __name__ == "__main__":
    sys.exit(main())
