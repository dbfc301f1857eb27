"""Prefix-tuning and prompt tuning (nn/prefix.py): they count and compute as Hugging Face PEFT
does on GPT-2 and BERT; decoding step by step gives the full pass's logits; training moves the
virtual tokens (and a new head) only; they save as adapters over a checked base and load back
the same; they cannot be merged, and the bad settings are refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from atencion.cli import main as cli
from atencion.errors import AtencionError
from atencion.interop import from_hf
from atencion.nn.model_dir import load_model_dir, weights_checksum
from atencion.nn.prefix import PrefixSpec, PromptSpec, apply_virtual
from atencion.nn.transformer import Transformer
from atencion.train.trainer import train
from conftest import small_model
from test_tasks import config, lm_sets, sentences

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LENGTH = 5
HEAD = ["classifier.linear.weight", "classifier.linear.bias"]  # BERT's new head (its pooler is the base's)


def _noisy(hf):
    """Biases and LayerNorms start at 0 and 1: move every weight so the comparison sees them all."""
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return hf.eval()


def gpt2():
    torch.manual_seed(0)
    return _noisy(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=99, n_positions=32, bos_token_id=1, eos_token_id=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)))


def bert():
    torch.manual_seed(0)
    return _noisy(transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=99,
        max_position_embeddings=40, type_vocab_size=2, pad_token_id=0, num_labels=3, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)))


def peft_config(kind: str, task: str, projection: bool = False, hidden: int = 0):
    if kind == "prompt":
        return peft.PromptTuningConfig(task_type=task, num_virtual_tokens=LENGTH)
    extra = {"encoder_hidden_size": hidden} if hidden else {}
    return peft.PrefixTuningConfig(task_type=task, num_virtual_tokens=LENGTH, prefix_projection=projection, **extra)


def spec(kind: str, projection: bool = False, hidden: int = 0):
    return PromptSpec(LENGTH) if kind == "prompt" else PrefixSpec(LENGTH, projection, hidden)


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def copy_virtual_tokens(theirs, ours: Transformer) -> None:
    """PEFT's prompt encoder's tensors into ours (the same names: embedding, transform.0, transform.2)."""
    stack = ours.encoder if ours.cfg.arch == "encoder" else ours.decoder
    module = stack.prefix if stack.prefix is not None else stack.prompt
    module.load_state_dict(theirs.prompt_encoder["default"].state_dict())


CASES = [("prefix", False, 0), ("prefix", True, 0), ("prefix", True, 32), ("prompt", False, 0)]


# Hugging Face PEFT as the independent implementation -------------------------------------------------


@pytest.mark.parametrize("kind,projection,hidden", CASES)
def test_gpt2_counts_and_computes_as_peft(kind, projection, hidden):
    hf = gpt2()
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft_config(kind, "CAUSAL_LM", projection, hidden)).eval()
    ours = from_hf(copy.deepcopy(hf)).eval()
    apply_virtual(ours, spec(kind, projection, hidden), "base", "0" * 64)
    assert trainable(ours) == trainable(theirs) > 0
    copy_virtual_tokens(theirs, ours)
    ids = torch.randint(1, 99, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = ours(ids)
        plain = from_hf(copy.deepcopy(hf)).eval()(ids)
    expected = expected[:, LENGTH:] if kind == "prompt" else expected  # PEFT's logits include the prompt's places
    assert (expected - plain).abs().max() > 1e-2  # the virtual tokens change the function ...
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)  # ... and ours as PEFT's


def peft_bert_logits(theirs, hf, ids, mask, types, kind):
    """PEFT's logits. Transformers 5 calls BERT's cache ``cache`` (``past_key_values`` only through a
    renaming wrapper), so PEFT's prefix forward cannot find it in the signature: call BERT with
    PEFT's own prefix (``get_prompt``) and mask, as PEFT's fallback path does (pooled output, then
    the classifier it trains)."""
    if kind == "prompt":
        return theirs(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
    visible = torch.cat([torch.ones(ids.size(0), LENGTH, dtype=mask.dtype), mask], dim=1)
    out = theirs.base_model.bert(input_ids=ids, attention_mask=visible, token_type_ids=types,
                                 past_key_values=theirs.get_prompt(ids.size(0)))
    return theirs.base_model.classifier(out[1])


@pytest.mark.parametrize("kind,projection,hidden", CASES)
def test_bert_classifier_counts_and_computes_as_peft(kind, projection, hidden):
    hf = bert()
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft_config(kind, "SEQ_CLS", projection, hidden)).eval()
    ours = from_hf(copy.deepcopy(hf)).eval()
    apply_virtual(ours, spec(kind, projection, hidden), "base", "0" * 64, trainable=HEAD)
    assert trainable(ours) == trainable(theirs) > 0
    copy_virtual_tokens(theirs, ours)
    ids = torch.randint(1, 99, (3, 10), generator=torch.Generator().manual_seed(1))
    ids[1, 7:], ids[2, 4:] = 0, 0  # padding, which the virtual tokens' mask must keep hidden
    types = torch.zeros_like(ids)
    types[:, 3:] = 1
    with torch.no_grad():
        expected = peft_bert_logits(theirs, hf, ids, (ids != 0).long(), types, kind)
        got = ours.classify(ids, token_type_ids=types)
        plain = from_hf(copy.deepcopy(hf)).eval().classify(ids, token_type_ids=types)
    assert (expected - plain).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def marian():
    torch.manual_seed(0)
    hf = transformers.MarianMTModel(transformers.MarianConfig(
        vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=0, eos_token_id=1, forced_eos_token_id=None, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))
    with torch.no_grad():  # every weight moved but the fixed sinusoids
        for name, p in hf.named_parameters():
            if "embed_positions" not in name:
                p.add_(0.1 * torch.randn_like(p))
    return hf.eval()


@pytest.mark.parametrize("kind", ["prefix", "prompt"])
def test_a_marian_translator_computes_as_peft(kind):
    """PEFT's seq2seq prefix reaches the decoder's self-attention only (it drops the
    cross-attention cache it builds; the encoder gets none), and its split of the table gives
    every decoder layer the first layer's keys and values: ours, given those in every layer,
    computes the same. Its prompt goes before the encoder's input; its table holds 2 · length
    rows of which the forward reads the first length, ours those length. Marian's features are
    sines then cosines, atencion's interleaved (interop/marian.py): the prompt is permuted alike."""
    from atencion.interop.marian import marian_to_paper_permutation

    hf = marian()
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft_config(kind, "SEQ_2_SEQ_LM")).eval()
    ours = from_hf(copy.deepcopy(hf)).eval()
    apply_virtual(ours, spec(kind), "base", "0" * 64)
    table = theirs.prompt_encoder["default"].embedding.weight.detach()
    with torch.no_grad():
        if kind == "prefix":
            assert trainable(ours) == trainable(theirs) > 0
            ours.decoder.prefix.embedding.weight.copy_(table[:, :2 * 32].repeat(1, 2))
        else:
            assert 2 * trainable(ours) == trainable(theirs) > 0
            ours.encoder.prompt.embedding.weight.copy_(table[:LENGTH, marian_to_paper_permutation(32)])
        src = torch.randint(2, 99, (3, 8), generator=torch.Generator().manual_seed(1))
        src[1, 6:] = 0
        tgt = torch.randint(2, 99, (3, 6), generator=torch.Generator().manual_seed(2))
        expected = theirs(input_ids=src, attention_mask=(src != 0).long(), decoder_input_ids=tgt).logits
        plain = from_hf(copy.deepcopy(hf)).eval()(src, tgt)
        got = ours(src, tgt)
    assert (expected - plain).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# decoding, training, files -----------------------------------------------------------------------------


def adapted(kind: str, arch: str = "decoder", **model):
    base = small_model(arch=arch, dropout=0.0, **model)
    ours = copy.deepcopy(base)
    apply_virtual(ours, spec(kind, projection=True), "base", "0" * 64)
    return base, ours.eval()


@pytest.mark.parametrize("kind", ["prefix", "prompt"])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("positional", ["learned", "rope"])
def test_decoding_step_by_step_gives_the_full_pass(kind, group, positional):
    """The first step puts the virtual tokens in the caches (a beam's rows each their own); later
    steps see them there, and the tokens keep the places after them."""
    _, model = adapted(kind, positional=positional)
    ids = torch.randint(4, model.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        rows = ids.repeat_interleave(group, 0)
        state = model.init_state(group=group)
        steps = [model.decode_step(rows[:, :3], state)]
        steps += [model.decode_step(rows[:, i:i + 1], state) for i in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full.repeat_interleave(group, 0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["prefix", "prompt"])
@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_a_step_moves_the_virtual_tokens_and_no_base_weight(kind, arch):
    base, model = adapted(kind, arch)
    model.train()
    virtual = {name for name, p in model.named_parameters() if p.requires_grad}
    assert virtual and all(f".{kind}." in name for name in virtual)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(4, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    model(ids).logsumexp(-1).mean().backward()
    optimizer.step()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) != (name in virtual), name
        assert (p.grad is not None) == (name in virtual), name


def test_a_saved_model_loads_back_with_the_same_outputs(tmp_path):
    base, model = adapted("prefix")
    base.save(tmp_path / "base")
    apply_virtual(model, model.virtual.spec, tmp_path / "base", weights_checksum(tmp_path / "base"))
    model.save(tmp_path / "adapted")
    assert sorted(p.name for p in (tmp_path / "adapted").iterdir()) == ["adapters.safetensors", "config.json",
                                                                         "prefix.json"]
    record = json.loads((tmp_path / "adapted" / "prefix.json").read_text())
    assert record == {"base": str((tmp_path / "base").resolve()), "base_sha256": weights_checksum(tmp_path / "base"),
                      "length": LENGTH, "projection": True, "hidden": 0}
    assert set(load_file(str(tmp_path / "adapted" / "adapters.safetensors"))) == \
        {name for name, p in model.named_parameters() if p.requires_grad}
    loaded = Transformer.load(tmp_path / "adapted")
    ids = torch.randint(4, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
        assert (loaded(ids) - base(ids)).abs().max() > 1e-2


def test_runs_train_only_the_virtual_tokens_and_the_head_and_the_commands_use_them(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in sentences(300)), encoding="utf-8")
    lm = train(config(tmp_path, "lm", *lm_sets(text), "train.max_steps=3", "train.valid_every=3"), tmp_path / "lm")
    sets = [*lm_sets(text), f"train.init_from={lm['best_model']}", "train.prefix={length: 4, projection: true}",
            "train.max_steps=3", "train.valid_every=3", "train.lr_peak=0.05"]
    with pytest.raises(AtencionError, match=r"data.block_size gives sequences of up to 32 tokens after the 4 "
                                            r"virtual places .* stop at model.max_positions=32"):
        train(config(tmp_path, "lm", *sets), tmp_path / "lm-prefix")
    assert not (tmp_path / "lm-prefix").exists()
    prefixed = train(config(tmp_path, "lm", *sets, "data.block_size=24"), tmp_path / "lm-prefix")
    with pytest.raises(AtencionError, match=r"was trained with train.prefix .*length=4.* but the config given now "
                                            r"has train.prefix .*length=2.*; the adapters cannot change on --resume"):
        train(config(tmp_path, "lm", *sets, "data.block_size=24", "train.prefix.length=2", "train.max_steps=6"),
              tmp_path / "lm-prefix", resume=True)
    tsv = tmp_path / "train.tsv"
    tsv.write_text("".join(f"{'pos' if 'cat' in s else 'neg'}\t{s}\n" for s in sentences(200, 1)), encoding="utf-8")
    mlm = train(config(tmp_path, "mlm", f"data.train_text={text}", "data.vocab_size=60", "train.max_steps=3",
                       "train.valid_every=3"), tmp_path / "mlm")
    prompted = train(config(tmp_path, "classify", f"data.train_tsv={tsv}", f"train.init_from={mlm['best_model']}",
                            "train.prompt.length=3", "train.max_steps=3", "train.valid_every=3"), tmp_path / "cls")
    for run, base, names in ((prefixed, lm, {"decoder.prefix.embedding.weight", "decoder.prefix.transform.0.weight",
                                             "decoder.prefix.transform.0.bias", "decoder.prefix.transform.2.weight",
                                             "decoder.prefix.transform.2.bias"}),
                             (prompted, mlm, {"encoder.prompt.embedding.weight", *HEAD})):
        last = Path(run["last_checkpoint"])
        assert not (last / "model.safetensors").exists()
        assert set(load_file(str(last / "adapters.safetensors"))) == names
        model, _ = load_model_dir(last)
        plain, _ = load_model_dir(base["best_model"])
        state = model.state_dict()
        for name, value in plain.state_dict().items():  # every base weight is the base's, unchanged
            if not name.startswith("classifier."):
                assert torch.equal(state[name], value), name
    (tmp_path / "lines.txt").write_text("the cat sat\na dog ran to the park\n")
    assert cli(["generate", "--model", prefixed["last_checkpoint"], "--prompt", "the", "--seed", "3",
                "--max-new-tokens", "8"]) == 0
    assert cli(["classify", "--model", prompted["last_checkpoint"], "--input", str(tmp_path / "lines.txt"),
                "--json"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) >= 3
    assert cli(["evaluate", "--model", prompted["last_checkpoint"], "--tsv", str(tsv)]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] >= 0
    serve_both(prefixed["last_checkpoint"], prompted["last_checkpoint"])
    for command in (["merge-lora", "--out", str(tmp_path / "merged")], ["export", "--format", "hf", "--out",
                                                                         str(tmp_path / "hf")]):
        assert cli([command[0], "--model", prompted["last_checkpoint"], *command[1:]]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "prompt tuning (train.prompt), which cannot be merged" in err
        assert not Path(command[-1]).exists()
    with pytest.raises(AtencionError, match=r"is adapted by prompt tuning \(train.prompt\), which cannot be merged"):
        train(config(tmp_path, "classify", f"data.train_tsv={tsv}", f"train.init_from={prompted['last_checkpoint']}",
                     "train.max_steps=3"), tmp_path / "again")
    assert not (tmp_path / "again").exists()


def serve_both(lm_dir: str, classifier_dir: str) -> None:
    """The server answers /generate, /classify and /attention from the adapted models."""
    from fastapi.testclient import TestClient

    from atencion.serve.app import LoadedModel, create_app
    from atencion.viz.attention import capture_self_attention

    models = [LoadedModel(name, path, *load_model_dir(path)) for name, path in (("lm", lm_dir),
                                                                                ("cls", classifier_dir))]
    with TestClient(create_app(models)) as client:
        r = client.post("/generate", json={"prompt": "the", "max_new_tokens": 5, "model": "lm"})
        assert r.status_code == 200, r.text
        r = client.post("/classify", json={"texts": ["the cat sat"], "model": "cls"})
        assert r.status_code == 200, r.text
        for name in ("lm", "cls"):
            r = client.post("/attention", json={"text": "the cat sat", "model": name})
            assert r.status_code == 200, r.text
    for model in models:  # the maps label the virtual places: a prompt's rows and columns, a prefix's columns
        maps = capture_self_attention(model.model, model.tokenizer, "the cat sat").self_attention
        assert maps.weights.shape[-2:] == (len(maps.rows), len(maps.cols))
        first = {"cls": ("<prompt 1>", "<prompt 1>"), "lm": (maps.rows[0], "<prefix 1>")}[model.name]
        assert (maps.rows[0], maps.cols[0]) == first and not maps.rows[0].startswith("<prefix")


# bad settings ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sets,message", [
    (["train.lora={rank: 2}", "train.prefix={length: 4}"], r"train.lora and train.prefix are given; .* keep one of"),
    (["train.prefix={length: 4}", "train.prompt={length: 4}"], r"train.prefix and train.prompt are given"),
    (["train.prefix={length: 0}"], r"train.prefix.length: expected an integer >= 1, got 0"),
    (["train.prefix={length: 4, depth: 2}"], r"train.prefix.depth: unknown key; train.prefix takes"),
    (["train.prefix={projection: maybe}"], r"train.prefix.projection: expected true or false, got 'maybe'"),
    (["train.prefix={hidden: 16}"], r"train.prefix.hidden: .* set projection: true"),
    (["train.prompt={init: text}"], r"train.prompt.init: expected one of \['random', 'vocab'\], got 'text'"),
    (["train.prompt=5"], r"train.prompt: expected a mapping"),
])
def test_bad_settings_are_refused_in_one_line(tmp_path, sets, message):
    with pytest.raises(AtencionError, match=message) as err:
        config(tmp_path, "lm", "data.train_text=x.txt", "train.init_from=somewhere", *sets)
    assert "\n" not in str(err.value)


def test_virtual_tokens_need_init_from_and_a_model_they_fit(tmp_path):
    with pytest.raises(AtencionError, match=r"train.prompt adapts a trained model: set train.init_from"):
        config(tmp_path, "lm", "data.train_text=x.txt", "train.prompt={length: 2}")
    with pytest.raises(AtencionError, match=r"positions 'alibi' add a bias by key position"):
        apply_virtual(small_model(arch="decoder", positional="alibi"), PrefixSpec(2), "base", "0" * 64)


@pytest.mark.parametrize("kind", ["prefix", "prompt"])
@pytest.mark.parametrize("group", [1, 2])
def test_an_encoder_decoder_decodes_step_by_step_as_its_full_pass(kind, group):
    """A prompt goes into the encoder (its places in the memory and its mask), a prefix into the
    decoder's self-attention."""
    base, model = adapted(kind, "encoder-decoder")
    src = torch.randint(4, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    src[1, 4:] = model.cfg.pad_id
    tgt = torch.randint(4, model.cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        memory, mask = model.encode(src)
        assert memory.shape[1] == (LENGTH + 6 if kind == "prompt" else 6)
        assert (model(src, tgt) - base(src, tgt)).abs().max() > 1e-2
        state = model.init_state(memory, mask, group=group)
        rows = tgt.repeat_interleave(group, 0)
        steps = torch.cat([model.decode_step(rows[:, i:i + 1], state) for i in range(5)], 1)
    torch.testing.assert_close(steps, model(src, tgt).repeat_interleave(group, 0), atol=1e-5, rtol=0)


def test_a_prompt_from_the_vocabulary_starts_as_tokens_embeddings():
    model = small_model(arch="decoder")
    apply_virtual(model, PromptSpec(4, "vocab"), "base", "0" * 64)
    table, rows = model.decoder.embed.weight, model.decoder.prompt.embedding.weight
    assert all(any(torch.equal(row, token) for token in table) for row in rows)
