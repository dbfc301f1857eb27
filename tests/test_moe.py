"""Mixture-of-experts feed-forward layers (nn/moe.py): routing, the load-balancing loss, the
capacity limit, the config's checks, decoding with the KV cache and beams, training, DDP."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from atencion import ModelConfig, Transformer
from atencion.cli import main
from atencion.decode import beam_search, greedy_search
from atencion.errors import AtencionError
from atencion.nn.layers import FeedForward, Residual
from atencion.nn.moe import MoEFeedForward, active_parameters, moe_aux_loss, moe_layers
from atencion.nn.quantize import quantize_int8
from atencion.train.config import load_config
from atencion.train.trainer import train
from conftest import random_batch, small_config, small_model
from test_training import one_and_two_processes, weights, write_corpus

MOE = {"experts": 4, "top_k": 2}
ROOT = Path(__file__).resolve().parents[1]


class Indicator(nn.Module):
    """An expert whose output is the one-hot vector of its own index: the layer's output for a
    token is then the vector of its gates."""

    def __init__(self, index: int, d_model: int):
        super().__init__()
        self.register_buffer("e", nn.functional.one_hot(torch.tensor(index), d_model).float())

    def forward(self, x):
        return self.e.expand(len(x), -1)


def routed_to_first(d_model: int, experts: int, k: int, capacity_factor: float) -> MoEFeedForward:
    """A layer whose router prefers expert 0, then 1, ... for inputs with positive coordinates."""
    torch.manual_seed(0)
    layer = MoEFeedForward(d_model, [FeedForward(d_model, 8) for _ in range(experts)], k, capacity_factor)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:, 0] = torch.arange(experts, 0, -1).float()
    return layer


# the layer -------------------------------------------------------------------------------------------------


def test_one_expert_with_top_1_equals_the_dense_ffn_with_the_same_weights():
    torch.manual_seed(0)
    ffn = FeedForward(16, 32, "gelu")
    x = torch.randn(3, 5, 16)
    assert torch.equal(MoEFeedForward(16, [ffn], top_k=1)(x), ffn(x))


def test_a_model_with_one_expert_and_top_1_equals_the_dense_model():
    dense = small_model(seed=0)
    sparse = Transformer(small_config(moe={"experts": 1, "top_k": 1})).eval()
    state = {name.replace(".ffn.", ".ffn.experts.0."): value for name, value in dense.state_dict().items()}
    missing, unexpected = sparse.load_state_dict(state, strict=False)
    assert not unexpected and all(name.endswith("ffn.router.weight") for name in missing) and missing
    src, tgt = random_batch(dense.cfg)
    torch.testing.assert_close(sparse(src, tgt), dense(src, tgt), rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_routing_sends_each_token_to_exactly_k_experts_with_weights_summing_to_1(k):
    torch.manual_seed(0)
    d_model, experts = 8, 5
    layer = MoEFeedForward(d_model, [Indicator(i, d_model) for i in range(experts)], k)
    x = torch.randn(4, 6, d_model)
    gates = layer(x).view(-1, d_model)[:, :experts]                   # token × expert
    assert ((gates > 0).sum(dim=1) == k).all()
    torch.testing.assert_close(gates.sum(dim=1), torch.ones(len(gates)))
    probs = layer.router(x.view(-1, d_model)).softmax(dim=-1)
    top = probs.topk(k, dim=-1)
    chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(1, top.indices, True)
    assert torch.equal(gates > 0, chosen)                            # the k most probable experts
    torch.testing.assert_close(gates.gather(1, top.indices), top.values / top.values.sum(1, keepdim=True))
    assert layer.routed.sum() == k * len(gates) and layer.tokens == len(gates)


def test_with_top_1_only_the_switch_gate_lets_the_task_train_the_router():
    """Renormalised, the gate of one chosen expert is p / p = 1: the output carries no gradient to
    the router. Switch's gate is p itself: the output is p · FFN(x), and the router learns."""
    torch.manual_seed(0)
    experts = [FeedForward(8, 16) for _ in range(3)]
    x = torch.randn(10, 8)
    for gate, learns in (("renormalize", False), ("switch", True)):
        layer = MoEFeedForward(8, experts, top_k=1, gate=gate)
        layer.router.weight.data.copy_(torch.randn(3, 8))
        out = layer(x)
        out.square().sum().backward()  # a task loss, without the auxiliary one
        grad = layer.router.weight.grad
        assert (grad is not None and grad.abs().sum() > 0) == learns, gate
        p = layer.router(x).softmax(dim=-1)
        chosen = p.argmax(dim=-1)
        scale = p.max(dim=-1).values[:, None] if gate == "switch" else 1.0
        expected = torch.stack([experts[int(c)](row) for c, row in zip(chosen, x)]) * scale
        torch.testing.assert_close(out, expected)


def test_the_auxiliary_loss_equals_its_formula_on_a_hand_computed_case_and_its_gradient_reaches_the_router():
    """Two experts, top-1, four tokens with router logits (ln 3, 0) ×3 and (0, ln 3): p is
    (3/4, 1/4) or (1/4, 3/4); expert 0 gets three tokens, f = (3/4, 1/4); P = (5/8, 3/8);
    L_aux = 2 · (3/4 · 5/8 + 1/4 · 3/8) = 9/8."""
    layer = MoEFeedForward(2, [FeedForward(2, 4), FeedForward(2, 4)], top_k=1)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(2))
    a = math.log(3)
    x = torch.tensor([[a, 0.0], [a, 0.0], [0.0, a], [a, 0.0]])
    layer(x)
    assert layer.aux_loss.item() == pytest.approx(9 / 8, abs=1e-6)
    assert layer.routed.tolist() == [3.0, 1.0]
    layer.aux_loss.backward()
    grad = layer.router.weight.grad
    assert grad is not None and grad.abs().sum() > 0
    assert all(p.grad is None for p in layer.experts.parameters())  # the loss reaches the router only
    with torch.no_grad():  # a step down its gradient moves probability away from the busy expert
        layer.router.weight -= 0.1 * grad
    layer(x)
    assert layer.aux_loss.item() < 9 / 8


def test_the_auxiliary_loss_equals_the_mixtral_load_balancing_loss_of_hugging_face():
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    torch.manual_seed(0)
    layer = MoEFeedForward(16, [FeedForward(16, 8) for _ in range(6)], top_k=2)
    x = torch.randn(40, 16)
    layer(x)
    expected = mixtral.load_balancing_loss_func((layer.router(x),), num_experts=6, top_k=2)
    torch.testing.assert_close(layer.aux_loss, expected)


def test_tokens_dropped_by_capacity_are_counted_and_pass_through_the_residual_unchanged():
    """Eight tokens all prefer expert 0; capacity 0.5 · 8 · 1 / 2 = 2 assignments per expert: the
    first two tokens are computed, the six after them dropped, and a pre-LN residual block
    returns those six exactly as they came in."""
    layer = routed_to_first(32, experts=2, k=1, capacity_factor=0.5).train()
    x = torch.rand(8, 32) + 0.1
    out = layer(x)
    assert int(layer.dropped) == 6 and layer.routed.tolist() == [8.0, 0.0]
    torch.testing.assert_close(out[:2], layer.experts[0](x[:2]))
    assert torch.equal(out[2:], torch.zeros(6, 32))
    residual = Residual(small_config(norm_first=True, dropout=0.0)).train()
    through, _ = residual(x, lambda h: (layer(h), None))
    unchanged = (through == x).all(dim=1)
    assert int(layer.dropped) >= 4 and unchanged.sum() == int(layer.dropped)  # (top-1: a token per assignment)
    layer.eval()  # no capacity at inference
    torch.testing.assert_close(layer(x), layer.experts[0](x))
    assert int(layer.dropped) == 0


def test_capacity_is_first_come_first_served_in_token_order_across_the_k_choices():
    layer = routed_to_first(4, experts=3, k=2, capacity_factor=0.75).train()  # C = ceil(0.75 · 4 · 2 / 3) = 2
    x = torch.rand(4, 4) + 0.1
    out = layer(x)  # every token chooses experts 0 and 1: tokens 0 and 1 fill both
    assert layer.routed.tolist() == [4.0, 4.0, 0.0] and int(layer.dropped) == 4
    gates = layer.router(x[:2]).softmax(dim=-1)[:, :2]
    gates = gates / gates.sum(dim=1, keepdim=True)
    expected = gates[:, :1] * layer.experts[0](x[:2]) + gates[:, 1:] * layer.experts[1](x[:2])
    torch.testing.assert_close(out[:2], expected)
    assert torch.equal(out[2:], torch.zeros(2, 4))


# the config ------------------------------------------------------------------------------------------------


def test_the_moe_setting_is_completed_with_its_defaults():
    assert small_config(moe={"experts": 3}).moe == {"experts": 3, "top_k": 2, "aux_loss_weight": 0.01,
                                                    "capacity_factor": 0.0, "layers": "all",
                                                    "gate": "renormalize"}
    assert ModelConfig.from_dict({"vocab_size": 40, "moe": {"experts": 2, "aux_loss_weight": "1e-3"}}).moe[
        "aux_loss_weight"] == 0.001


@pytest.mark.parametrize("moe, message", [
    ({"experts": 2, "top_k": 3}, r"moe.top_k \(3\) must be at most moe.experts \(2\)"),
    ({"experts": 0}, "moe.experts must be an integer >= 1, got 0"),
    ({"experts": 2, "top_k": 0}, "moe.top_k must be an integer >= 1"),
    ({"experts": 2.5}, "moe.experts must be an integer"),
    ({"top_k": 1}, "moe.experts is missing"),
    ({"experts": 2, "topk": 1}, r"moe.topk is not a setting of moe; its keys are \['experts', 'top_k'"),
    ({"experts": 2, "aux_loss_weight": -1}, "moe.aux_loss_weight must be a number >= 0"),
    ({"experts": 2, "capacity_factor": float("nan")}, "moe.capacity_factor must be a number >= 0"),
    ({"experts": 2, "layers": "odd"}, "moe.layers must be one of"),
    ({"experts": 2, "gate": "sum"}, r"moe.gate must be one of \['renormalize', 'switch'\]"),
    (4, "moe must be a mapping"),
])
def test_bad_moe_settings_are_refused_naming_the_key(moe, message):
    with pytest.raises(AtencionError, match=message):
        small_config(moe=moe)


def test_every_other_layer_has_experts_from_the_second_on_in_both_stacks():
    model = Transformer(small_config(n_layers=4, moe={"experts": 3, "top_k": 1, "layers": "every_other"}))
    for stack in (model.encoder, model.decoder):
        assert [isinstance(b.ffn, MoEFeedForward) for b in stack.layers] == [False, True, False, True]
    per_expert = sum(p.numel() for p in model.encoder.layers[1].ffn.experts[0].parameters())
    assert active_parameters(model) == model.num_parameters() - 4 * 2 * per_expert
    with pytest.raises(AtencionError, match="moe.layers every_other"):
        small_config(n_layers=1, moe={"experts": 2, "layers": "every_other"})


def test_a_dotted_set_fills_the_moe_mapping():
    cfg = load_config(None, ["task=lm", "model.moe.experts=4", "model.moe.capacity_factor=1.5"])
    assert cfg.model["moe"] == {"experts": 4, "capacity_factor": 1.5}
    assert cfg.model_config(50, None).moe["capacity_factor"] == 1.5


@pytest.mark.parametrize("sets, key", [(["model.moe.experts=2", "model.moe.top_k=3"], "model.moe.top_k"),
                                       (["model.moe.experts=0"], "model.moe.experts")])
def test_train_refuses_bad_moe_settings_with_one_line_exit_2_and_writes_nothing(tmp_path, capsys, sets, key):
    data = write_corpus(tmp_path / "data", n=20)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{preset: tiny, d_model: 32, d_ff: 64, n_layers: 1, n_heads: 2}}\n"
                      f"data: {{train_src: {data['data.train_src']}, train_tgt: {data['data.train_tgt']}}}\n")
    code = main(["train", str(config), "--out", str(tmp_path / "run"), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert key in err and str(config) in err
    assert not (tmp_path / "run").exists()


# decoding --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["encoder-decoder", "decoder"])
@pytest.mark.parametrize("layers", ["all", "every_other"])
def test_incremental_decoding_with_the_kv_cache_equals_the_full_pass(arch, layers):
    model = small_model(arch=arch, moe={**MOE, "capacity_factor": 1.0, "layers": layers})
    src, tgt = random_batch(model.cfg)
    if arch == "decoder":
        full, state = model(tgt), model.init_state()
    else:
        full, state = model(src, tgt), model.init_state(*model.encode(src))
    steps = [model.decode_step(tgt[:, :2], state)]
    steps += [model.decode_step(tgt[:, t: t + 1], state) for t in range(2, tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_beam_search_runs_on_experts_and_beam_1_equals_greedy():
    model = small_model(1, output_bias=True, tie_output=False, moe=MOE)
    with torch.no_grad():
        model.generator.bias[3] = 2.0  # EOS: translations of varied lengths
    src, _ = random_batch(model.cfg, batch=4, src_len=8)
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    assert [h[0].tokens for h in beam_search(model, src, beam_size=1, max_len_a=1.0, max_len_b=5)] == greedy
    beams = beam_search(model, src, beam_size=3, max_len_a=1.0, max_len_b=5, nbest=3)
    assert len(beams) == 4 and all(1 <= len(hyps) <= 3 for hyps in beams)


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_the_single_stack_archs_classify_and_the_encoder_packs_its_real_positions(arch):
    model = small_model(arch=arch, num_labels=3, moe=MOE)
    src, _ = random_batch(model.cfg, batch=4, src_len=9)
    assert model.classify(src).shape == (4, 3) and len(moe_layers(model)) == 2
    real = src != model.cfg.pad_id
    unpacked, _ = model(src, return_attention=True)  # (the encoder packs unless asked for its weights)
    torch.testing.assert_close(model(src)[real], unpacked[real], atol=1e-5, rtol=1e-5)


def test_an_int8_model_with_experts_routes_and_decodes_as_the_float_model_does():
    model = small_model(moe=MOE)
    quantized = quantize_int8(model)
    assert not any(isinstance(m, nn.Linear) for m in quantized.modules())  # the router too
    src, tgt = random_batch(model.cfg)
    choices = {}  # each MoE layer's top-k experts per token, float and int8

    def keep(name):
        return lambda module, args, logits: choices.setdefault(name, []).append(logits.topk(MOE["top_k"]).indices)

    for name, m in (("float", model), ("int8", quantized)):
        for layer in moe_layers(m):
            layer.router.register_forward_hook(keep(name))
    with torch.no_grad():
        want, got = model(src, tgt), quantized(src, tgt)
    # the same experts for nearly every token (int8 may swap a near tie), in every MoE layer
    same = torch.cat([(f.sort().values == q.sort().values).all(-1) for f, q in zip(choices["float"], choices["int8"])])
    assert len(choices["float"]) == len(choices["int8"]) == len(moe_layers(model))
    assert same.float().mean() >= 0.9
    # the logits within int8's error (~2 % per position, as for dense layers) at most positions, quantized not
    # copied; a token whose experts changed may be further off
    per_position = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert 1e-4 < per_position.median() < 0.05 and (per_position < 0.05).float().mean() >= 0.75
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    out = greedy_search(quantized, src, max_len_a=0.0, max_len_b=6)
    assert len(out) == len(src) and all(1 <= len(row) <= 6 for row in out)
    assert out == greedy_search(model, src, max_len_a=0.0, max_len_b=6)


def test_save_and_load_round_trip_keeps_the_experts(tmp_path):
    model = small_model(moe={**MOE, "layers": "every_other"})
    model.save(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["moe"] == model.cfg.moe
    loaded = Transformer.load(tmp_path / "m").eval()
    src, tgt = random_batch(model.cfg)
    assert torch.equal(loaded(src, tgt), model(src, tgt))


def test_exporters_refuse_experts_with_one_line_naming_moe(tmp_path):
    from atencion.export import export
    from atencion.interop import to_hf

    model = small_model(moe=MOE)
    pytest.importorskip("transformers")
    with pytest.raises(AtencionError, match=r"export to hf: moe \(mixture-of-experts"):
        export(model, tmp_path / "out", "hf")
    assert not (tmp_path / "out").exists()
    with pytest.raises(AtencionError, match=r"to_hf: moe"):
        to_hf(model)


# training --------------------------------------------------------------------------------------------------


def lm_config(tmp_path, *sets):
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = tmp_path / "text.txt"
    text.write_text("".join(f"the cat {i % 7} sat on the mat {i % 5} and the dog ran\n" for i in range(200)))
    return load_config(None, [
        "task=lm", f"data.train_text={text}", "data.tokenizer=char", "data.block_size=32", "train.max_tokens=256",
        "model.n_layers=2", "model.d_model=32", "model.d_ff=32", "model.n_heads=2", "model.max_positions=32",
        "model.dropout=0.0", "train.warmup=5", "train.lr_peak=0.003", "train.progress=false",
        "train.tensorboard=false", "train.threads=1", "train.max_steps=6", "train.log_every=2",
        "model.moe.experts=3", *sets])


def test_an_lm_run_with_experts_logs_their_token_shares_dropped_assignments_and_the_aux_loss(tmp_path):
    train(lm_config(tmp_path, "model.moe.capacity_factor=0.5", "model.moe.layers=every_other"), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r and "moe_share" in r]
    assert [r["step"] for r in logged] == [2, 4, 6]
    for r in logged:
        assert len(r["moe_share"]) == 1 and len(r["moe_share"][0]) == 3  # layer 1 of 2, three experts
        assert sum(r["moe_share"][0]) == pytest.approx(1, abs=1e-3)
        assert r["moe_dropped"] > 0.45  # capacity is half the mean load (rounded up): about half is dropped
        assert 0 < r["moe_aux"] <= 3  # L_aux ≤ E, as f_i ≤ 1 and Σ P_i = 1
    model = Transformer.load(tmp_path / "run" / "best")
    assert len(moe_layers(model)) == 1 and model.cfg.moe["capacity_factor"] == 0.5


def test_the_aux_loss_weight_enters_the_training_loss(tmp_path):
    """One update with and without the load-balancing loss: the routers move differently; the
    last layer's experts, whose output feeds no router, get the task's gradient alone."""
    with_aux = train(lm_config(tmp_path / "a", "model.moe.aux_loss_weight=1.0", "train.max_steps=1"),
                     tmp_path / "a" / "run")
    without = train(lm_config(tmp_path / "b", "model.moe.aux_loss_weight=0", "train.max_steps=1"),
                    tmp_path / "b" / "run")
    a, b = weights(Path(with_aux["last_checkpoint"])), weights(Path(without["last_checkpoint"]))
    routers = [name for name in a if name.endswith("ffn.router.weight")]
    assert routers and all(not torch.equal(a[name], b[name]) for name in routers)
    last = [name for name in a if name.startswith("decoder.layers.1.ffn.experts.")]
    assert last and all(torch.equal(a[name], b[name]) for name in last)
    assert moe_aux_loss(Transformer.load(Path(with_aux["last_checkpoint"]))) is None  # before a forward pass


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_processes_with_experts_equal_one_process_with_the_same_total_batch(tmp_path):
    """As test_training's DDP test, with experts in every layer. Eight experts, top-1: some get no
    token in a step, so they have no gradient (DDP must be told: find_unused_parameters). The
    capacity limit (half the mean load: assignments are dropped) is on too: it counts the
    assignments of one forward pass, that is one micro-batch, and each process runs the very
    micro-batches the single process accumulates, so the limits, and the weights, must agree."""
    data = write_corpus(tmp_path / "data")
    settings = {**data, "data.vocab_size": 40, "model.d_model": 32, "model.d_ff": 32, "model.n_layers": 1,
                "model.n_heads": 2, "model.dropout": 0.0, "model.moe.experts": 8, "model.moe.top_k": 1,
                "model.moe.aux_loss_weight": 0.1, "model.moe.capacity_factor": 0.5, "train.max_tokens": 256,
                "train.warmup": 20, "train.lr_peak": 0.01, "train.progress": False, "train.tensorboard": False,
                "train.threads": 1, "train.max_steps": 4, "train.log_every": 1, "train.device": "cpu"}
    one_dir, two_dir = one_and_two_processes(settings, tmp_path, 29537)
    one, two = weights(one_dir), weights(two_dir)
    assert any("experts" in name for name in one)
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-6, rtol=1e-5)
    logs = [[json.loads(x) for x in (tmp_path / run / "log.jsonl").read_text().splitlines() if '"moe_share"' in x]
            for run in ("one", "two")]
    assert len(logs[0]) == 4
    assert any(0.0 in row for r in logs[1] for row in r["moe_share"])  # an expert idle in both processes
    for a, b in zip(*logs, strict=True):  # the shares count both processes' tokens
        assert a["moe_share"] == b["moe_share"] and a["moe_dropped"] == b["moe_dropped"] > 0
        assert a["moe_aux"] == pytest.approx(b["moe_aux"], abs=1e-5)
