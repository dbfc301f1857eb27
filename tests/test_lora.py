"""LoRA (nn/lora.py): adapters start as the identity, merge exactly, count and compute as Hugging
Face PEFT does, leave the base frozen, save only themselves with a checked reference to their
base; every command works on the adapted and the merged form alike; the bad inputs it refuses."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn.utils import parametrize

from atencion.cli import main as cli
from atencion.errors import AtencionError
from atencion.nn.lora import LoRALinear, LoraSpec, apply_lora, merge_lora, select_targets
from atencion.nn.model_dir import load_model_dir
from atencion.nn.transformer import Transformer
from atencion.train.checkpoint import average_checkpoints, list_checkpoints
from atencion.train.trainer import train
from conftest import random_batch, small_model
from test_tasks import config, lm_sets, sentences
from test_training import one_and_two_processes, tiny_config, write_corpus

ROOT = Path(__file__).resolve().parent.parent


def adapted(model: Transformer, targets="all", rank: int = 4, alpha: float = 8.0, randomise: bool = True):
    """A copy of ``model`` with adapters on ``targets``; B random unless ``randomise`` is False."""
    model = copy.deepcopy(model)
    apply_lora(model, LoraSpec(rank, alpha, 0.0, targets), "base", "0" * 64)
    if randomise:  # B of a linear layer and A of an embedding table start at zero
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("lora_A", "lora_B")):
                    p.normal_(std=0.1)
    return model.eval()


def run(model: Transformer, arch: str):
    src, tgt = random_batch(model.cfg)
    return model(src, tgt) if arch == "encoder-decoder" else model(src)


ARCHS = ["encoder-decoder", "encoder", "decoder"]


# the adapter ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_the_adapter_starts_as_the_identity(arch):
    base = small_model(arch=arch, dropout=0.0)
    model = adapted(base, ["all", "embeddings"], randomise=False)
    assert all(name.endswith(("lora_A", "lora_B")) for name, p in model.named_parameters() if p.requires_grad)
    assert torch.equal(run(model, arch), run(base, arch))  # B = 0: exactly the base model


@pytest.mark.parametrize("arch", ARCHS)
def test_the_merged_model_equals_the_adapted_one(arch):
    """Embedding adapters included: the output projection tied to the table reads the adapted
    table before merging, as it reads the merged one after."""
    base = small_model(arch=arch, dropout=0.0)
    model = adapted(base, ["all", "embeddings"])
    before = run(model, arch)
    assert (before - run(base, arch)).abs().max() > 1e-2  # the adapters change the function ...
    merged = merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in merged.modules()) and merged.lora is None
    assert not any(parametrize.is_parametrized(m) for m in merged.modules())
    if arch != "encoder":
        assert merged.generator.weight is merged.decoder.embed.weight  # still one tied table
    torch.testing.assert_close(run(merged, arch), before, atol=1e-5, rtol=0)  # ... and merging keeps it


@pytest.mark.parametrize("targets", ["attention", "ffn", "all", ["out_proj"], ["decoder.layers.*.cross_attn.in_proj"],
                                     ["embeddings", "ffn"]])
def test_the_trainable_parameters_are_rank_times_d_in_plus_d_out_per_target(targets):
    base = small_model(arch="encoder-decoder")
    model = adapted(base, targets, rank=4)
    expected = 0
    for name in model.lora.modules:
        if name == "encoder.embed":  # vocabulary × d_model, one table for both stacks
            expected += 4 * (base.cfg.vocab_size + base.cfg.d_model)
            continue
        layer = model.get_submodule(name).base
        expected += 4 * (layer.in_features + layer.out_features)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected > 0


# Hugging Face PEFT as the independent implementation (these tests alone skip without peft) ----------------


def peft_model(base: Transformer, targets: list[str], rank: int, alpha: float):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets)
    return peft.inject_adapter_in_model(config, copy.deepcopy(base)).eval()


@pytest.mark.parametrize("arch,targets", [("encoder-decoder", ["in_proj", "out_proj"]),
                                          ("encoder-decoder", ["in_proj", "out_proj", "linear1", "linear2"]),
                                          ("decoder", ["linear1", "linear2"]), ("encoder", ["in_proj"])])
def test_peft_counts_the_same_trainable_parameters_and_computes_the_same_outputs(arch, targets):
    base = small_model(arch=arch, dropout=0.0)
    ours = adapted(base, targets, rank=4, alpha=8.0)
    theirs = peft_model(base, targets, rank=4, alpha=8.0)
    count = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
    assert count == sum(p.numel() for p in ours.parameters() if p.requires_grad)
    with torch.no_grad():
        for name in ours.lora.modules:
            mine, peft_layer = ours.get_submodule(name), theirs.get_submodule(name)
            peft_layer.lora_A["default"].weight.copy_(mine.lora_A)
            peft_layer.lora_B["default"].weight.copy_(mine.lora_B)
    torch.testing.assert_close(run(ours, arch), run(theirs, arch), atol=1e-5, rtol=1e-5)


# training: the base stays frozen -------------------------------------------------------------------


def test_a_lora_step_gives_no_gradient_to_the_base_weights():
    model = adapted(small_model(arch="decoder", dropout=0.0)).train()
    src, _ = random_batch(model.cfg)
    model(src).square().mean().backward()
    for name, p in model.named_parameters():
        assert (p.grad is not None) == name.endswith(("lora_A", "lora_B")), name


@pytest.fixture
def translator(tmp_path):
    """A tiny trained translator (plain weights) and the data it was trained on."""
    data = write_corpus(tmp_path / "data")
    summary = train(tiny_config(data, **{"train.max_steps": 6, "train.valid_every": 6}), tmp_path / "base")
    return Path(summary["last_checkpoint"]), data


def lora_config(data, base: Path, **extra):
    return tiny_config(data, **{"train.init_from": str(base),
                                "train.lora": "{rank: 2, alpha: 4, targets: [all, embeddings]}",
                                "train.valid_every": 3, "train.lr_peak": 0.05, **extra})


def test_a_lora_run_trains_only_the_adapters_and_saves_only_them(translator, tmp_path):
    base_dir, data = translator
    summary = train(lora_config(data, base_dir, **{"train.max_steps": 6}), tmp_path / "lora")
    last = Path(summary["last_checkpoint"])
    assert not (last / "model.safetensors").exists()
    record = json.loads((last / "lora.json").read_text())
    assert record["base"] == str(base_dir.resolve()) and record["rank"] == 2
    saved = load_file(str(last / "adapters.safetensors"))
    assert saved and all(name.endswith(("lora_A", "lora_B")) for name in saved)
    base, _ = load_model_dir(base_dir)
    model = Transformer.load(last)  # base + adapters, unmerged
    state = model.state_dict()
    for name, value in base.state_dict().items():  # every base weight is the base's, unchanged
        module, _, tensor = name.rpartition(".")  # as named in a model with adapters:
        mine = [state[n] for n in (name, f"{module}.base.{tensor}", f"{module}.parametrizations.{tensor}.original")
                if n in state]
        assert len(mine) == 1 and torch.equal(mine[0], value), name
    assert any(saved[name].abs().sum() > 0 for name in saved if name.endswith("lora_B"))  # B has moved
    optimizer = load_file(str(last / "optimizer.safetensors"))  # Adam's moments: the adapters' only
    moments = sum(t.numel() for name, t in optimizer.items() if name.endswith(("exp_avg", "exp_avg_sq")))
    assert moments == 2 * sum(t.numel() for t in saved.values())


def test_a_lora_run_resumes_exactly(translator, tmp_path):
    base_dir, data = translator
    train(lora_config(data, base_dir, **{"train.max_steps": 6}), tmp_path / "whole")
    train(lora_config(data, base_dir, **{"train.max_steps": 3}), tmp_path / "split")
    train(lora_config(data, base_dir, **{"train.max_steps": 6}), tmp_path / "split", resume=True)
    whole = load_file(str(list_checkpoints(tmp_path / "whole" / "checkpoints")[-1] / "adapters.safetensors"))
    split = load_file(str(list_checkpoints(tmp_path / "split" / "checkpoints")[-1] / "adapters.safetensors"))
    assert whole.keys() == split.keys()
    for name in whole:
        assert torch.equal(whole[name], split[name]), name


def test_averaging_lora_checkpoints_averages_the_merged_models(translator, tmp_path):
    base_dir, data = translator
    train(lora_config(data, base_dir, **{"train.max_steps": 6}), tmp_path / "lora")
    checkpoints = list_checkpoints(tmp_path / "lora" / "checkpoints")
    assert len(checkpoints) == 2
    average_checkpoints(checkpoints, tmp_path / "avg")
    a, b = (load_model_dir(c)[0].state_dict() for c in checkpoints)
    averaged = load_file(str(tmp_path / "avg" / "model.safetensors"))
    for name, value in averaged.items():
        torch.testing.assert_close(value, (a[name] + b[name]) / 2)


# the two forms through the commands -------------------------------------------------------------


def test_translate_export_and_merge_lora_work_on_both_forms_alike(translator, tmp_path, capsys):
    base_dir, data = translator
    summary = train(lora_config(data, base_dir, **{"train.max_steps": 6}), tmp_path / "lora")
    lora_dir, merged_dir = Path(summary["last_checkpoint"]), tmp_path / "merged"
    assert cli(["merge-lora", "--model", str(lora_dir), "--out", str(merged_dir)]) == 0
    capsys.readouterr()
    assert (merged_dir / "model.safetensors").is_file() and not (merged_dir / "lora.json").exists()
    source = Path(data["data.train_src"]).read_text().splitlines()[:20]
    (tmp_path / "src.txt").write_text("\n".join(source) + "\n")
    outputs = []
    for model_dir in (lora_dir, merged_dir):
        assert cli(["translate", "--model", str(model_dir), "--input", str(tmp_path / "src.txt"), "--beam", "2"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 20
    pytest.importorskip("ctranslate2")
    for name, model_dir in (("a", lora_dir), ("b", merged_dir)):
        assert cli(["export", "--model", str(model_dir), "--format", "ctranslate2", "--out", str(tmp_path / name)]) == 0
    assert (tmp_path / "a" / "model.bin").read_bytes() == (tmp_path / "b" / "model.bin").read_bytes()


def test_generate_fill_mask_and_classify_work_on_both_forms_alike(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("".join(s + "\n" for s in sentences(300)), encoding="utf-8")
    lm = train(config(tmp_path, "lm", *lm_sets(text), "train.max_steps=4", "train.valid_every=4"), tmp_path / "lm")
    adapted_lm = train(config(tmp_path, "lm", *lm_sets(text), f"train.init_from={lm['best_model']}",
                              "train.lora={rank: 2, targets: ffn}", "train.max_steps=3", "train.valid_every=3",
                              "train.lr_peak=0.05"), tmp_path / "lm-lora")
    tsv = tmp_path / "train.tsv"
    tsv.write_text("".join(f"{'pos' if 'cat' in s else 'neg'}\t{s}\n" for s in sentences(200, 1)), encoding="utf-8")
    mlm = train(config(tmp_path, "mlm", f"data.train_text={text}", "data.vocab_size=60", "train.max_steps=3",
                       "train.valid_every=3"), tmp_path / "mlm")
    cls = train(config(tmp_path, "classify", f"data.train_tsv={tsv}", f"train.init_from={mlm['best_model']}",
                       "train.lora={rank: 2}", "train.max_steps=3", "train.valid_every=3"), tmp_path / "cls")
    adapted_mlm = train(config(tmp_path, "mlm", f"data.train_text={text}", f"train.init_from={mlm['best_model']}",
                               "train.lora={rank: 2, targets: all}", "train.max_steps=3", "train.valid_every=3",
                               "train.lr_peak=0.05"), tmp_path / "mlm-lora")
    cls_dir = Path(cls["last_checkpoint"])
    head = load_file(str(cls_dir / "adapters.safetensors"))
    assert {"classifier.linear.weight", "classifier.linear.bias"} <= head.keys()  # the new head is trained
    (tmp_path / "lines.txt").write_text("the cat sat\na dog ran to the park\n")
    for model_dir, command in ((Path(adapted_lm["last_checkpoint"]), ["generate", "--prompt", "the", "--seed", "3",
                                                                     "--max-new-tokens", "12"]),
                               (cls_dir, ["classify", "--input", str(tmp_path / "lines.txt"), "--json"]),
                               (Path(adapted_mlm["last_checkpoint"]), ["fill-mask", "--text", "the <mask> sat",
                                                                       "--json"])):
        merged = tmp_path / f"merged-{model_dir.parent.parent.name}"
        assert cli(["merge-lora", "--model", str(model_dir), "--out", str(merged)]) == 0
        capsys.readouterr()
        outputs = []
        for form in (model_dir, merged):
            assert cli([command[0], "--model", str(form), *command[1:]]) == 0
            outputs.append(capsys.readouterr().out)
        assert outputs[0] == outputs[1] and outputs[0].strip()


# bad input -----------------------------------------------------------------------------------------


def atencion(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "atencion", *args], capture_output=True, text=True, cwd=cwd)


@pytest.mark.parametrize("lora,message", [
    ("{rank: 2, targets: [query]}", r"train.lora.targets: 'query' matches no linear layer"),
    ("{rank: 0}", r"train.lora.rank: expected an integer >= 1, got 0"),
    ("{rank: 33}", r"train.lora.rank: 33 is larger than layer .* allows; expected at most 32"),
    ("{rank: 2, size: 3}", r"train.lora.size: unknown key"),
])
def test_bad_lora_settings_are_one_line_with_status_2_and_nothing_written(translator, tmp_path, lora, message):
    base_dir, data = translator
    sets = [*(f"{k}={v}" for k, v in data.items()), "data.vocab_size=40", "model.preset=tiny", "model.d_model=32",
            "model.d_ff=64", "model.n_layers=1", "model.n_heads=2", f"train.init_from={base_dir}",
            f"train.lora={lora}"]
    result = atencion("train", "configs/reference.yaml", *(a for s in sets for a in ("--set", s)),
                      "--out", str(tmp_path / "out"))
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "out").exists()


def test_lora_needs_init_from_and_a_plain_base(translator, tmp_path):
    base_dir, data = translator
    with pytest.raises(AtencionError, match=r"train.lora adapts a trained model: set train.init_from"):
        tiny_config(data, **{"train.lora": "{rank: 2}"})
    summary = train(lora_config(data, base_dir, **{"train.max_steps": 3}), tmp_path / "lora")
    with pytest.raises(AtencionError, match=r"is a LoRA model; .*atencion merge-lora"):
        train(lora_config(data, Path(summary["last_checkpoint"]), **{"train.max_steps": 3}), tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_a_lora_model_whose_base_is_missing_or_changed_is_refused(translator, tmp_path):
    base_dir, data = translator
    lora_dir = Path(train(lora_config(data, base_dir, **{"train.max_steps": 3}), tmp_path / "lora")["last_checkpoint"])
    (tmp_path / "in.txt").write_text("uno dos\n")
    moved = base_dir.with_name("moved")
    base_dir.rename(moved)
    result = atencion("translate", "--model", str(lora_dir), "--input", str(tmp_path / "in.txt"))
    assert result.returncode == 2 and f"its base model {base_dir} is missing" in result.stderr, result.stderr
    moved.rename(base_dir)
    weights = base_dir / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 1
    from safetensors.torch import save_file

    save_file(tensors, str(weights))
    result = atencion("translate", "--model", str(lora_dir), "--input", str(tmp_path / "in.txt"))
    assert result.returncode == 2 and "has changed since these adapters were trained" in result.stderr
    record = json.loads((lora_dir / "lora.json").read_text())
    (lora_dir / "lora.json").write_text(json.dumps({**record, "base": 5}))
    result = atencion("translate", "--model", str(lora_dir), "--input", str(tmp_path / "in.txt"))
    assert result.returncode == 2 and "lora.json: 'base' must be a str, got 5" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_merge_lora_refuses_a_plain_model_and_an_occupied_out(translator, tmp_path):
    base_dir, _ = translator
    assert cli(["merge-lora", "--model", str(base_dir), "--out", str(tmp_path / "m")]) == 2
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert cli(["merge-lora", "--model", str(base_dir), "--out", str(tmp_path / "full")]) == 2
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


def test_each_target_shorthand_chooses_its_layers_and_no_others():
    model = small_model(arch="encoder-decoder")
    names = select_targets(model, LoraSpec(targets=["attention"]))
    assert "decoder.layers.0.cross_attn.in_proj" in names and "encoder.layers.1.self_attn.out_proj" in names
    assert not any("linear" in n for n in names)
    assert select_targets(model, LoraSpec(targets=["ffn"])) == [
        f"{stack}.layers.{i}.ffn.linear{j}" for stack in ("encoder", "decoder") for i in range(2) for j in (1, 2)]


def test_resume_refuses_a_changed_lora_setting(translator, tmp_path):
    base_dir, data = translator
    train(lora_config(data, base_dir, **{"train.max_steps": 3}), tmp_path / "lora")
    changed = lora_config(data, base_dir, **{"train.max_steps": 6, "train.lora": "{rank: 4, alpha: 4, targets: all}"})
    with pytest.raises(AtencionError, match=r"was trained with train.lora .*rank=2.* the adapters cannot change"):
        train(changed, tmp_path / "lora", resume=True)
    plain = tiny_config(data, **{"train.max_steps": 6, "train.init_from": str(base_dir)})
    with pytest.raises(AtencionError, match=r"but the config given now has no train.lora"):
        train(plain, tmp_path / "lora", resume=True)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_processes_train_the_same_adapters_as_one_process(translator, tmp_path):
    """torchrun with 2 CPU processes (gloo), 1 micro-batch each = 1 process accumulating 2; the
    frozen base weights take no part in the gradient exchange. Dropout off (each process draws
    its own masks)."""
    base_dir, data = translator
    settings = {**data, "data.vocab_size": 40, "model.preset": "tiny", "model.d_model": 32, "model.d_ff": 64,
                "model.n_layers": 1, "model.n_heads": 2, "model.dropout": 0.0, "train.max_tokens": 256,
                "train.warmup": 5, "train.lr_peak": 0.01, "train.progress": False, "train.tensorboard": False,
                "train.threads": 1, "train.max_steps": 4, "train.device": "cpu", "train.init_from": str(base_dir),
                "train.lora": "{rank: 2, alpha: 4, targets: all}"}
    one, two = (load_file(str(c / "adapters.safetensors")) for c in one_and_two_processes(settings, tmp_path, 29533))
    assert one.keys() == two.keys() and any(v.abs().sum() > 0 for k, v in one.items() if k.endswith("lora_B"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=1e-5)


def test_an_adapter_whose_base_is_a_model_of_another_shape_is_refused_in_one_line(translator, tmp_path):
    from atencion.nn.model_dir import weights_checksum

    base_dir, data = translator
    lora_dir = Path(train(lora_config(data, base_dir, **{"train.max_steps": 3}), tmp_path / "lora")["last_checkpoint"])
    wider = Path(train(tiny_config(data, **{"train.max_steps": 2, "model.d_ff": 48}), tmp_path / "wider")
                 ["last_checkpoint"])
    record = json.loads((lora_dir / "lora.json").read_text())  # named with its checksum: it passes that check
    (lora_dir / "lora.json").write_text(json.dumps({**record, "base": str(wider),
                                                    "base_sha256": weights_checksum(wider)}))
    (tmp_path / "in.txt").write_text("uno dos\n")
    result = atencion("translate", "--model", str(lora_dir), "--input", str(tmp_path / "in.txt"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and str(wider) in result.stderr, result.stderr
    assert "do not fit" in result.stderr and "(48," in result.stderr, result.stderr
