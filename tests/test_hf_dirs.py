"""Any Hugging Face model directory works where a model directory is asked for: random-initialised
transformers models saved with ``save_pretrained`` beside a tokenizer trained here with the
`tokenizers` library (or, for Marian, SentencePiece models and a vocab.json), run through the
command line and compared with transformers on the same directory."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from atencion.cli import main as cli  # noqa: E402
from atencion.decode.sample import generate_ids  # noqa: E402
from atencion.interop import from_hf  # noqa: E402
from atencion.nn.model_dir import directory_kind, load_model, load_model_dir  # noqa: E402
from atencion.tasks.lm import prompt_ids  # noqa: E402
from atencion.tasks.mlm import masked_ids  # noqa: E402

TEXTS = ["the cat sat on the mat.", "a dog ran in the park!", "the quick brown fox jumps over the lazy dog,",
         "she sells sea shells by the sea shore", "how much wood would a woodchuck chuck"] * 4
CHAT = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def byte_level_bpe():
    """GPT-2's kind of tokenizer, trained here: byte-level BPE with <|endoftext|>, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>")
    fast.chat_template = CHAT
    return fast


def wordpiece():
    """BERT's kind of tokenizer, trained here: lowercased WordPiece, [CLS] … [SEP] around a sentence."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(TEXTS, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                       special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


def marian_tokenizer(work: Path):
    """Marian's tokenizer: a SentencePiece model per language, trained here, and the vocab.json that numbers
    their pieces (</s> 0, <unk> 1, <pad> last), as MarianTokenizer reads them."""
    import sentencepiece as spm

    for name, texts in (("source", TEXTS), ("target", [t.upper() for t in TEXTS])):
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=40,
                                       model_type="unigram", minloglevel=2, hard_vocab_limit=False)
        (work / f"{name}.spm").write_bytes(model.getvalue())
    pieces = []
    for name in ("source", "target"):
        processor = spm.SentencePieceProcessor(model_file=str(work / f"{name}.spm"))
        pieces += [processor.id_to_piece(i) for i in range(3, processor.get_piece_size())]
    vocab = {"</s>": 0, "<unk>": 1, **{p: i + 2 for i, p in enumerate(dict.fromkeys(pieces))}}
    vocab["<pad>"] = len(vocab)
    (work / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    return transformers.MarianTokenizer(str(work / "source.spm"), str(work / "target.spm"), str(work / "vocab.json"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Hugging Face model directories as save_pretrained writes them: GPT-2 (and sharded), BERT with a
    masked-LM head and as a sequence classifier, Marian."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {name: root / name for name in ("gpt2", "sharded", "bert", "bert-cls", "gpt2-cls", "marian")}
    bpe, wp = byte_level_bpe(), wordpiece()
    gpt2 = transformers.GPT2Config(vocab_size=len(bpe), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                   bos_token_id=0, eos_token_id=0, initializer_range=0.3)
    model = transformers.GPT2LMHeadModel(gpt2)
    model.save_pretrained(out["gpt2"])
    model.save_pretrained(out["sharded"], max_shard_size="20KB")
    for name in ("gpt2", "sharded"):
        bpe.save_pretrained(out[name])
    labels = {"id2label": {0: "neg", 1: "neu", 2: "pos"}, "label2id": {"neg": 0, "neu": 1, "pos": 2}}
    transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=len(bpe), n_positions=64, n_embd=32, n_layer=1, n_head=4, pad_token_id=0, initializer_range=0.3,
        **labels)
    ).save_pretrained(out["gpt2-cls"])
    bpe.save_pretrained(out["gpt2-cls"])
    bert = dict(vocab_size=len(wp), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=64, pad_token_id=0, initializer_range=0.3)
    transformers.BertForMaskedLM(transformers.BertConfig(**bert)).save_pretrained(out["bert"])
    transformers.BertForSequenceClassification(transformers.BertConfig(**bert, **labels)).save_pretrained(
        out["bert-cls"])
    for name in ("bert", "bert-cls"):
        wp.save_pretrained(out[name])
    (root / "spm").mkdir()
    marian_tok = marian_tokenizer(root / "spm")
    pad = marian_tok.pad_token_id
    transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=len(marian_tok), d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0, forced_eos_token_id=None, init_std=1.0)
    ).save_pretrained(out["marian"])
    marian_tok.save_pretrained(out["marian"])
    return out


def run(*args: str) -> tuple[int, str, str]:
    """atencion's command line in this process: (exit status, stdout, stderr)."""
    import contextlib

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(args))
    return code, out.getvalue(), err.getvalue()


def hf_tokenizer(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


# the tokenizers --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "bert", "marian"])
def test_a_hugging_face_tokenizer_gives_transformers_ids(dirs, name):
    _, tokenizer = load_model_dir(dirs[name])
    theirs = hf_tokenizer(dirs[name])
    for text in ("the cat sat on the mat.", "How MUCH wood, zebra?", "  shells  by the shore\n", "ünïcödé 😀"):
        ids = tokenizer.sentence(text)
        assert ids == theirs(text).input_ids
        assert tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True)


# generate --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "sharded"])
def test_generate_on_a_gpt2_directory_gives_the_tokens_of_transformers_greedy_generate(dirs, name):
    hf = transformers.GPT2LMHeadModel.from_pretrained(dirs[name]).eval()
    model, tokenizer = load_model_dir(dirs[name])
    prompt = "the cat sat"
    ids = prompt_ids(tokenizer, prompt)
    assert ids == hf_tokenizer(dirs[name])(prompt).input_ids
    theirs = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)[0, len(ids):].tolist()
    ours = generate_ids(model, torch.tensor([ids]), 20, temperature=0, stop_id=tokenizer.specials.stop)[0].tolist()
    end = theirs.index(0) + 1 if 0 in theirs else len(theirs)  # transformers pads a finished row after its EOS
    assert ours[:end] == theirs[:end] and len(ours) >= end
    code, out, _ = run("generate", "--model", str(dirs[name]), "--prompt", prompt, "--temperature", "0",
                       "--max-new-tokens", "20")
    assert code == 0 and out == hf_tokenizer(dirs[name]).decode(ids + theirs, skip_special_tokens=True) + "\n"


def test_streamed_text_waits_for_a_character_whose_bytes_come_in_two_tokens(dirs, monkeypatch):
    """Byte-level BPE can give a character's bytes in separate tokens ("ñ" is C3 B1): the text
    shown while it streams holds the half character back, and the whole text is shown in the end."""
    from atencion.tasks import lm

    model, tokenizer = load_model_dir(dirs["gpt2"])
    theirs = hf_tokenizer(dirs["gpt2"])
    byte_ids = [theirs.convert_tokens_to_ids(piece) for piece in ("Ã", "±")]  # the byte-level pieces of C3, B1
    chosen = [*theirs(" a").input_ids, *byte_ids, *theirs("o ").input_ids, byte_ids[0]]  # ' año ' and half a char
    assert theirs.decode(chosen) == " año \ufffd"

    def steps(model, rows, max_new_tokens, *args, on_step=None, **kwargs):
        for step, token in enumerate(chosen):
            on_step(step, torch.tensor([token]))
        return torch.tensor([chosen])

    monkeypatch.setattr(lm, "generate_ids", steps)
    shown = []
    texts = lm.generate_text(model, tokenizer, "the cat", max_new_tokens=len(chosen), temperature=0,
                             on_text=lambda k, text: shown.append(text))
    assert "".join(shown) == texts[0] == " año \ufffd"  # the last half character is shown as the text ends
    assert all("\ufffd" not in piece for piece in shown[:-1])


def test_generate_chat_writes_the_prompt_through_the_chat_template(dirs):
    model, tokenizer = load_model_dir(dirs["gpt2"])
    theirs = hf_tokenizer(dirs["gpt2"])
    chat = theirs.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True,
                                      tokenize=True)
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert prompt_ids(tokenizer, "the cat", chat=True) == list(chat) != prompt_ids(tokenizer, "the cat")
    code, out, _ = run("generate", "--model", str(dirs["gpt2"]), "--prompt", "the cat", "--chat", "--temperature",
                       "0", "--max-new-tokens", "5")
    expected = generate_ids(model, torch.tensor([list(chat)]), 5, temperature=0, stop_id=tokenizer.specials.stop)
    assert code == 0 and out == "the cat" + tokenizer.decode(expected[0].tolist()) + "\n"


# Today's decoders as save_pretrained writes them: Llama (grouped-query attention), Mistral (and a
# sliding window of 6 keys, shorter than the 20 tokens generated), Qwen2 (biases on q, k, v).
DECODERS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 6}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {}),
}


@pytest.fixture(scope="module", params=list(DECODERS))
def llama_dir(request, tmp_path_factory) -> Path:
    return save_llama_dir(request.param, tmp_path_factory.mktemp("hf") / request.param)


def save_llama_dir(family: str, directory: Path) -> Path:
    """A Llama-family model (``family``, a key of DECODERS) with grouped-query attention (2 key/value
    heads of 4), its biases (Qwen2's q, k, v) and norm gains random, as save_pretrained writes it into
    ``directory``, beside a byte-level BPE trained here that starts each text with <s>, as Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    architecture, config, extra = DECODERS[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(getattr(transformers, config)(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
        **extra))
    with torch.no_grad():  # transformers starts biases at 0 and norm gains at 1: randomised, so that each is read
        for name, p in model.named_parameters():
            if "bias" in name or "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def test_generate_on_a_llama_directory_reads_its_safetensors_and_gives_transformers_greedy_tokens(llama_dir,
                                                                                                  monkeypatch):
    """The Llama family's directories load through its name map (no transformers model is built):
    `generate` gives the tokens of transformers' greedy ``generate``, and with itself as --draft the same."""
    from atencion.interop import hf_dir

    family = llama_dir.name
    hf = getattr(transformers, DECODERS[family][0]).from_pretrained(llama_dir).eval()
    theirs_tokenizer = hf_tokenizer(llama_dir)
    prompt = "the cat sat"
    ids = theirs_tokenizer(prompt).input_ids
    theirs = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20)[0, len(ids):].tolist()

    def through_transformers(directory, architecture):
        raise AssertionError(f"{architecture} was loaded through transformers, not from its safetensors")

    monkeypatch.setattr(hf_dir, "_through_transformers", through_transformers)
    model, tokenizer = load_model_dir(llama_dir)
    assert (model.cfg.n_heads, model.cfg.n_kv_heads, model.cfg.activation) == (4, 2, "swiglu")
    assert model.cfg.qkv_bias == (family == "qwen2")
    assert (model.cfg.attention or {}).get("window") == DECODERS[family][2].get("sliding_window")
    assert ids[0] == 1 and prompt_ids(tokenizer, prompt) == ids
    code, out, _ = run("generate", "--model", str(llama_dir), "--prompt", prompt, "--temperature", "0",
                       "--max-new-tokens", "20")
    assert code == 0 and out == theirs_tokenizer.decode(ids + theirs, skip_special_tokens=True) + "\n"
    assert len(set(theirs)) > 3  # a text that varies, not one token repeated
    code, drafted, err = run("generate", "--model", str(llama_dir), "--draft", str(llama_dir), "--prompt", prompt,
                             "--temperature", "0", "--max-new-tokens", "20")
    if family == "mistral":  # a sliding window's cache keeps no keys to roll back to: refused in one line
        assert code == 2 and "cannot" in err and "window" in err and drafted == ""
    else:
        assert code == 0 and drafted == out  # speculative decoding: the target's own greedy text


# fill-mask and classify -------------------------------------------------------------------------


def test_fill_mask_on_a_bert_directory_ranks_tokens_as_transformers_does(dirs):
    hf = transformers.BertForMaskedLM.from_pretrained(dirs["bert"]).eval()
    _, tokenizer = load_model_dir(dirs["bert"])
    theirs = hf_tokenizer(dirs["bert"])
    ids = theirs("the [MASK] sat on the [MASK].").input_ids
    assert masked_ids(tokenizer, "the <mask> sat on the <mask>.") == ids
    with torch.no_grad():
        probabilities = hf(torch.tensor([ids])).logits[0, torch.tensor(ids) == theirs.mask_token_id].softmax(-1)
    code, out, _ = run("fill-mask", "--model", str(dirs["bert"]), "--text", "the <mask> sat on the <mask>.",
                       "--top-k", "3", "--json")
    assert code == 0
    for mask, row in zip(json.loads(out)["masks"], probabilities):
        top = row.topk(3)
        assert [m["token"] for m in mask] == [theirs.decode([i]) for i in top.indices.tolist()]
        assert [m["probability"] for m in mask] == pytest.approx(top.values.tolist(), abs=1e-6)


@pytest.mark.parametrize("name, cls", [("bert-cls", "BertForSequenceClassification"),
                                       ("gpt2-cls", "GPT2ForSequenceClassification")])
def test_classify_on_a_sequence_classification_directory_gives_transformers_labels(dirs, name, cls, tmp_path):
    hf = getattr(transformers, cls).from_pretrained(dirs[name]).eval()
    theirs = hf_tokenizer(dirs[name])
    lines = ["the cat sat on the mat.", "a dog", "how much wood would a woodchuck chuck"]
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    code, out, _ = run("classify", "--model", str(dirs[name]), "--input", str(tmp_path / "in.txt"), "--json")
    assert code == 0
    converted = from_hf(hf)  # the same head from the model transformers loaded
    for line, answer in zip(lines, out.splitlines()):
        ids = torch.tensor([theirs(line).input_ids])
        with torch.no_grad():
            p = hf(ids).logits[0].softmax(-1)
            assert (converted.classify(ids)[0].softmax(-1) - p).abs().max() <= 1e-6
        answer = json.loads(answer)
        assert answer["label"] == hf.config.id2label[int(p.argmax())]
        assert list(answer["probabilities"].values()) == pytest.approx(p.tolist(), abs=1e-6)


# translate, evaluate ----------------------------------------------------------------------------


def test_translate_on_a_marian_directory_gives_transformers_greedy_translation(dirs, tmp_path):
    hf = transformers.MarianMTModel.from_pretrained(dirs["marian"]).eval()
    theirs = hf_tokenizer(dirs["marian"])
    lines = ["the cat sat on the mat.", "she sells sea shells"]
    (tmp_path / "src.txt").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    code, out, _ = run("translate", "--model", str(dirs["marian"]), "--input", str(tmp_path / "src.txt"),
                       "--beam", "1", "--max-len-a", "0", "--max-len-b", "12")
    assert code == 0
    for line, ours in zip(lines, out.splitlines()):
        batch = theirs(line, return_tensors="pt")
        tokens = hf.generate(**batch, num_beams=1, do_sample=False, max_new_tokens=12,
                             bad_words_ids=[[theirs.pad_token_id]])
        assert ours == theirs.decode(tokens[0], skip_special_tokens=True)


def test_evaluate_a_gpt2_directory_gives_transformers_loss(dirs, tmp_path):
    text = "the cat sat on the mat.\nhow much wood would a woodchuck chuck\n"
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    code, out, _ = run("evaluate", "--model", str(dirs["gpt2"]), "--text", str(tmp_path / "text.txt"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(dirs["gpt2"]).eval()
    ids = torch.tensor([hf_tokenizer(dirs["gpt2"])(text).input_ids])
    with torch.no_grad():
        loss = float(hf(ids, labels=ids).loss)
    assert code == 0 and json.loads(out)["loss"] == pytest.approx(loss, rel=1e-5)


# import, the stored dtype, and the other commands ------------------------------------------------


def test_import_writes_an_atencion_directory_with_the_same_logits_and_tokenizer(dirs, tmp_path):
    for name in ("gpt2", "bert-cls", "marian"):
        code, out, _ = run("import", str(dirs[name]), "--out", str(tmp_path / name))
        assert code == 0 and json.loads(out)["dtype"] == "float32"
        assert directory_kind(tmp_path / name) == "atencion"
        (ours, tokenizer), (converted, original) = load_model_dir(tmp_path / name), load_model_dir(dirs[name])
        assert ours.cfg == converted.cfg
        assert tokenizer.sentence("the cat sat") == original.sentence("the cat sat")
        ids = torch.tensor([original.sentence("the cat sat")])
        with torch.no_grad():
            if ours.cfg.num_labels:
                assert torch.equal(ours.classify(ids), converted.classify(ids))
            elif ours.cfg.arch == "encoder-decoder":
                assert torch.equal(ours(ids, ids[:, :3]), converted(ids, ids[:, :3]))
            else:
                assert torch.equal(ours(ids), converted(ids))


def test_weights_keep_their_stored_dtype_until_a_command_asks_for_float32(dirs, tmp_path):
    transformers.GPT2LMHeadModel.from_pretrained(dirs["gpt2"]).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(dirs["gpt2"] / name, tmp_path / "bf16")
    stored = load_model(tmp_path / "bf16", dtype=None)
    assert {p.dtype for p in stored.parameters()} == {torch.bfloat16}
    assert load_model(tmp_path / "bf16").decoder.embed.weight.dtype == torch.float32
    code, out, _ = run("import", str(tmp_path / "bf16"), "--out", str(tmp_path / "imported"))
    assert code == 0 and json.loads(out)["dtype"] == "bfloat16"
    assert torch.equal(load_model(tmp_path / "imported", dtype=None).decoder.embed.weight,
                       stored.decoder.embed.weight)


def test_attention_and_export_take_a_hugging_face_directory(dirs, tmp_path):
    code, out, _ = run("attention", "--model", str(dirs["bert"]), "--src", "the cat sat", "--out",
                       str(tmp_path / "maps"))
    assert code == 0 and (tmp_path / "maps" / "encoder.png").is_file()
    assert json.loads(out.splitlines()[-1])["tokens"] == len(hf_tokenizer(dirs["bert"])("the cat sat").input_ids)
    code, _, _ = run("export", "--model", str(dirs["marian"]), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert code == 0
    exported = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    original = transformers.MarianMTModel.from_pretrained(dirs["marian"]).eval()
    ids = torch.tensor([hf_tokenizer(tmp_path / "hf")("the cat sat").input_ids])
    with torch.no_grad():
        a = exported(input_ids=ids, decoder_input_ids=ids[:, :3]).logits
        b = original(input_ids=ids, decoder_input_ids=ids[:, :3]).logits
    assert (a - b).abs().max() < 1e-4


def test_train_init_from_fine_tunes_a_hugging_face_gpt2_and_adapts_a_bert_with_lora(dirs, tmp_path):
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    text = tmp_path / "text.txt"
    text.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    tsv = tmp_path / "train.tsv"
    tsv.write_text("".join(f"{'pos' if 'the' in t else 'neg'}\t{t}\n" for t in TEXTS), encoding="utf-8")
    common = ["train.max_steps=2", "train.valid_every=2", "train.progress=false", "train.tensorboard=false",
              "train.threads=1", "train.warmup=1"]
    for task, sets in (("lm", [f"data.train_text={text}", f"train.init_from={dirs['gpt2']}", "data.block_size=16",
                               "train.max_tokens=64"]),
                       ("classify", [f"data.train_tsv={tsv}", f"data.valid_tsv={tsv}", "data.max_len=32",
                                     f"train.init_from={dirs['bert']}", "train.lora={rank: 2}",
                                     "train.max_tokens=256"])):
        (tmp_path / f"{task}.yaml").write_text(f"task: {task}\n", encoding="utf-8")
        summary = train(load_config(tmp_path / f"{task}.yaml", [*common, *sets]), tmp_path / task)
        model, tokenizer = load_model_dir(summary["last_checkpoint"])
        assert tokenizer.sentence("the cat") == hf_tokenizer(dirs["gpt2" if task == "lm" else "bert"])(
            "the cat").input_ids
    code, out, _ = run("classify", "--model", summary["last_checkpoint"], "--input", str(tmp_path / "train.tsv"))
    assert code == 0 and len(out.splitlines()) == len(TEXTS)


# bad input: one line, exit 2, nothing written -----------------------------------------------------


def test_an_unsupported_model_type_is_named_with_the_supported_ones(dirs, tmp_path):
    bad = tmp_path / "xlnet"
    shutil.copytree(dirs["gpt2"], bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "xlnet",
                                                 "architectures": ["XLNetLMHeadModel"]}))
    for args in (["generate", "--model", str(bad)], ["import", str(bad), "--out", str(tmp_path / "out")]):
        code, out, err = run(*args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert "model_type 'xlnet' is not supported; supported: " in err
        listed = set(err.split("supported: ")[1].strip().split(", "))
        assert {"bert", "bloom", "gpt2", "gpt_neox", "marian", "t5"} <= listed
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", ["tokenizer.json", "model-00002-of-", "source.spm"])
def test_a_missing_tokenizer_or_shard_is_named(dirs, tmp_path, missing):
    source = dirs["marian" if missing == "source.spm" else "sharded"]
    broken = tmp_path / "broken"
    shutil.copytree(source, broken)
    (gone,) = [path for path in broken.iterdir() if path.name.startswith(missing)]
    gone.unlink()
    command = "translate" if missing == "source.spm" else "generate"
    for args in ([command, "--model", str(broken)], ["import", str(broken), "--out", str(tmp_path / "out")]):
        code, out, err = run(*args)
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
        assert str(gone) in err or (missing == "source.spm" and "source.spm" in err), err
    assert not (tmp_path / "out").exists()


def test_serve_shows_a_bert_directory_s_heads_as_transformers_computes_them(dirs):
    from fastapi.testclient import TestClient

    from atencion.serve.app import LoadedModel, create_app

    model, tokenizer = load_model_dir(dirs["bert"])
    hf = transformers.BertForMaskedLM.from_pretrained(dirs["bert"], attn_implementation="eager").eval()
    ids = hf_tokenizer(dirs["bert"])("the cat sat on the mat.").input_ids
    with torch.no_grad():
        theirs = torch.stack(hf(torch.tensor([ids]), output_attentions=True).attentions)[:, 0]  # layers, heads, q, k
    with TestClient(create_app([LoadedModel("bert", str(dirs["bert"]), model, tokenizer)])) as client:
        assert client.get("/info").json()["models"][0]["endpoints"] == ["/fill-mask", "/attention"]
        answer = client.post("/attention", json={"text": "the cat sat on the mat."}).json()
    encoder = answer["attention"]["pieces"]["encoder"]
    assert len(encoder["rows"]) == len(ids) and encoder["rows"][0] == "[CLS]" and encoder["rows"][-1] == "[SEP]"
    # WordPiece's pieces grouped into the words its pre-tokenizer cut ("##" goes on with a word)
    cut = hf_tokenizer(dirs["bert"]).backend_tokenizer.pre_tokenizer.pre_tokenize_str("the cat sat on the mat.")
    words = [word for word, _ in cut]
    assert answer["attention"]["words"]["encoder"]["rows"] == ["[CLS]", *words, "[SEP]"]
    assert (torch.tensor(encoder["weights"]) - theirs).abs().max() <= 1e-5  # the answer rounds to 5 decimals


def test_a_family_with_only_its_from_hf_importer_loads_through_transformers(dirs, monkeypatch):
    """A family whose module reads no checkpoint (as a new one may start: its IMPORTERS entry and
    ``from_X`` only, no MODEL_TYPE) still serves its directories, through transformers'
    from_pretrained, and its model_type is listed as supported."""
    import sys
    import types

    from atencion.interop import IMPORTERS, gpt2
    from atencion.interop.hf_dir import supported

    direct = load_model(dirs["gpt2"])
    new = types.ModuleType("atencion.interop.newfamily")
    new.from_newfamily = gpt2.from_gpt2
    monkeypatch.setitem(sys.modules, new.__name__, new)
    monkeypatch.setitem(IMPORTERS, "GPT2LMHeadModel", ("newfamily", "from_newfamily"))
    monkeypatch.delitem(IMPORTERS, "GPT2ForSequenceClassification")
    through = load_model(dirs["gpt2"])
    ids = torch.tensor([[5, 17, 2, 40]])
    assert through.cfg == direct.cfg and torch.equal(through(ids), direct(ids))
    assert "gpt2" in supported()
