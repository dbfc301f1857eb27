"""Continuous batching (decode/continuous.py): requests that join a running batch mid-generation,
leave it at a stop token, at their length or cancelled, and share its steps, get at every step the
logits of the same request run alone (``decode_step`` one token at a time, within 1e-4) and the
tokens of ``generate_ids`` alone, greedy or sampled with a seeded generator, on the batched path
(RoPE with any number of key/value heads, learned and sinusoidal positions) and on the fallback
(ALiBi, another attention kind, a mixture of experts); admission keeps to max_sequences, max_tokens
and max_queue and refuses what could never run; log-probabilities equal log_softmax of the full
forward pass; Engine.run runs other work on the model's thread; a failing step ends every running
sequence with an error and the engine serves on."""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from atencion.config import ModelConfig
from atencion.decode import continuous
from atencion.decode.continuous import Engine, Event, QueueFull, Sequence, splits
from atencion.decode.sample import generate_ids
from atencion.errors import AtencionError
from atencion.nn.prefix import PrefixSpec, apply_virtual
from atencion.nn.transformer import Transformer

VOCAB = 300
TIMEOUT = 30.0  # seconds any wait may take before the test fails (nothing here takes more than a fraction)
TOLERANCE = 1e-4


def build(preset: str, seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(ModelConfig.preset(preset, vocab_size=VOCAB, **{"dropout": 0.0, **overrides})).eval()


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def alone_logits(model, ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The next-token logits of ``ids`` followed by ``tokens``, the request run alone: the prompt
    read whole by ``decode_step``, then one token at a time."""
    with torch.inference_mode():
        state = model.init_state()
        logits = [model.decode_step(torch.tensor([ids]), state, last=1)[0, -1].float()]
        for token in tokens[:-1]:
            logits.append(model.decode_step(torch.tensor([[token]]), state)[0, -1].float())
    return logits


def greedy_alone(model, ids: list[int], n: int) -> list[int]:
    return generate_ids(model, torch.tensor([ids]), n, temperature=0)[0].tolist()


class Owner:
    """A sequence's owner: the events it hears (on the engine's thread), how many sequences ran at
    each, and ``done`` set at its end. ``then(owner, event)`` runs after each event is recorded."""

    def __init__(self, engine: Engine | None = None, then=None):
        self.engine, self.then = engine, then
        self.events: list[Event] = []
        self.running: list[int] = []
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if self.engine is not None:
            self.running.append(len(self.engine.running))
        if self.then is not None:
            self.then(self, event)
        if event.finish is not None or event.error is not None:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def ends(self) -> list[str]:
        """Every end heard: finish reasons, and "error" for an error."""
        return [e.finish if e.error is None else "error" for e in self.events if e.finish or e.error]

    def wait(self) -> None:
        assert self.done.wait(TIMEOUT), f"no end heard; events so far: {self.events}"


@contextmanager
def engine_of(model, **limits):
    engine = Engine(model, **limits)
    try:
        yield engine
    finally:
        engine.stop(TIMEOUT)


@contextmanager
def stalled(engine: Engine):
    """The engine's thread held inside an ``Engine.run`` call until the block ends (so what is
    submitted meanwhile waits, deterministically)."""
    started, release, results = threading.Event(), threading.Event(), []

    def work():
        started.set()
        release.wait(TIMEOUT)
        return "released"

    thread = threading.Thread(target=lambda: results.append(asyncio.run(engine.run(work, TIMEOUT))))
    thread.start()
    assert started.wait(TIMEOUT)
    try:
        yield
    finally:
        release.set()
        thread.join(TIMEOUT)
    assert results == ["released"]


def staggered(engine: Engine, plan: list[tuple[list[int], int, tuple[int, int] | None]], **choice):
    """Sequences of ``plan`` (prompt, max_new_tokens, after): submitted at once when ``after`` is None,
    else from inside the owner's event of sequence j's k-th token, ``after`` = (j, k) (those with the
    same trigger together). Returns (sequences, owners) once all have ended."""
    sequences: list[Sequence] = []
    heard: dict[int, int] = {}

    def then(owner: Owner, event: Event) -> None:
        if event.token is None:
            return
        j = owners.index(owner)
        heard[j] = heard.get(j, 0) + 1
        due = [sequences[i] for i, (_, _, after) in enumerate(plan) if after == (j, heard[j])]
        if due:
            engine.submit(*due)

    owners = [Owner(engine, then) for _ in plan]
    for (ids, n, _), owner in zip(plan, owners):
        sequences.append(Sequence(ids, n, owner, **{"temperature": 0.0, **choice}, logits=[]))
    engine.submit(*[s for s, (_, _, after) in zip(sequences, plan) if after is None])
    for owner in owners:
        owner.wait()
    return sequences, owners


def assert_alone(model, sequence: Sequence, owner: Owner) -> None:
    """Every logit vector of ``sequence`` within TOLERANCE of the request run alone."""
    tokens = owner.tokens
    assert len(sequence.logits) == len(tokens)
    for step, (got, want) in enumerate(zip(sequence.logits, alone_logits(model, sequence.ids, tokens))):
        error = float((got - want).abs().max())
        assert error <= TOLERANCE, f"step {step} of the prompt of {len(sequence.ids)}: logits off by {error}"


# 1. requests that join mid-generation: the logits and greedy tokens of each run alone ------------------

# sequence 0 runs alone, is joined by 1 (then 2: three rows), is alone again once they leave (its
# row back to caches of its own), then joined by 3, by 4 (submitted at 3's first token, which comes
# from 3's prompt) and by 5 and 6 together (five rows); 5 leaves before 3, 4 and 6 (a row moved)
PLAN = [(prompt(5, 0), 32, None), (prompt(1, 1), 6, (0, 3)), (prompt(9, 2), 4, (1, 2)),
        (prompt(3, 3), 8, (0, 16)), (prompt(12, 4), 10, (3, 1)), (prompt(2, 5), 3, (0, 20)),
        (prompt(7, 6), 5, (0, 20))]

MODELS = {  # name: (preset, overrides, whether its step splits by row[, "layers": without the whole-step kernel])
    "llama-gqa": ("llama-tiny", {}, True),
    "llama-gqa-layers": ("llama-tiny", {}, True, "layers"),
    "llama-mqa": ("llama-tiny", {"n_kv_heads": 1}, True),
    "llama-mha": ("llama-tiny", {"n_kv_heads": 4}, True),
    "llama-rope-scaled": ("llama-tiny", {"rope_scaling": {"type": "linear", "factor": 2.0}}, True),
    "gpt-learned": ("gpt-tiny", {}, True),
    "gpt-sinusoidal": ("gpt-tiny", {"positional": "sinusoidal"}, True),
    "llama-alibi": ("llama-tiny", {"positional": "alibi"}, False),
    "llama-window": ("llama-tiny", {"attention": {"kind": "window", "window": 4}}, False),
    "gpt-moe": ("gpt-tiny", {"moe": {"experts": 4, "top_k": 2}}, False),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_joining_mid_generation_matches_each_request_alone(name, monkeypatch):
    from atencion.nn import fused

    preset, overrides, splitting, *layers = MODELS[name]
    model = build(preset, **overrides)
    assert splits(model) is splitting
    if layers:  # batch_step: the layer-by-layer path, where matvec.cpp's whole step does not apply
        monkeypatch.setattr(continuous.Engine, "_kernel_plan", lambda self, rows: None)
    kernel, real = [], continuous.kernel_step
    monkeypatch.setattr(continuous, "kernel_step", lambda *args: kernel.append(1) or real(*args))
    with engine_of(model) as engine:
        sequences, owners = staggered(engine, PLAN)
        steps = engine.steps
    for sequence, owner in zip(sequences, owners):
        assert owner.ends == ["length"] and owner.events[-1].finish == "length"
        assert owner.tokens == greedy_alone(model, sequence.ids, sequence.max_new_tokens)
        assert_alone(model, sequence, owner)
    seen = owners[0].running  # the schedule did what it says: 0 alone, in company, alone again, in company
    first_company = next(i for i, n in enumerate(seen) if n > 1)
    alone_again = next(i for i in range(first_company, len(seen)) if seen[i] == 1)
    assert max(seen) >= 3 and max(seen[alone_again:]) >= 3
    if splitting:
        assert steps > 0  # the batched step ran (the rows were not just stepped one by one)
    else:
        assert steps == 0
    with torch.no_grad():
        whole_step = fused.plan(model.decoder, 2) is not None  # a Llama block, and the kernels compiled here
    assert bool(kernel) == (whole_step and not layers)  # each row at its own position in matvec.cpp's step



@pytest.mark.parametrize("count", [17, 20])
def test_more_rows_than_the_kernel_takes_are_stepped_in_parts_each_as_alone(count, monkeypatch):
    """Past PANEL_ROWS (16) rows the whole-step kernel runs in parts of equal size (17: 9 + 8), each
    over its own rows of the slots; every request still matches itself alone."""
    from atencion.nn import fused

    model = build("llama-tiny")
    with torch.no_grad():
        if fused.plan(model.decoder, 8) is None:
            pytest.skip("the whole-step kernel does not apply here")
    sizes, real = [], continuous.kernel_step
    monkeypatch.setattr(continuous, "kernel_step", lambda *args: sizes.append(len(args[2])) or real(*args))
    with engine_of(model, max_sequences=count) as engine:
        owners = [Owner(engine) for _ in range(count)]
        sequences = [Sequence(prompt(2 + i % 5, 300 + i), 4 + i % 3, owner, temperature=0.0, logits=[])
                     for i, owner in enumerate(owners)]
        with stalled(engine):  # all join in one turn
            engine.submit(*sequences)
        for owner in owners:
            owner.wait()
    assert max(sizes) <= 16 and sum(sizes[:2]) == count and abs(sizes[0] - sizes[1]) <= 1
    for sequence, owner in zip(sequences, owners):
        assert owner.tokens == greedy_alone(model, sequence.ids, sequence.max_new_tokens)
        assert_alone(model, sequence, owner)

# 2. sampling: a seeded generator draws the same tokens alone and in company -----------------------------

SAMPLED = [dict(temperature=0.8, top_k=40, top_p=0.9), dict(temperature=1.3), dict(temperature=1.0, top_p=0.5)]


@pytest.mark.parametrize("name", ["llama-gqa", "gpt-learned", "llama-alibi"])
def test_seeded_samples_are_the_same_alone_and_in_company(name):
    preset, overrides, _ = MODELS[name]
    model = build(preset, **overrides)
    prompts = [prompt(4, 10), prompt(11, 11), prompt(2, 12)]
    wanted = [generate_ids(model, torch.tensor([ids]), 12, generator=torch.Generator().manual_seed(7 + i),
                           **choice)[0].tolist() for i, (ids, choice) in enumerate(zip(prompts, SAMPLED))]
    with engine_of(model) as engine:
        sampled = [Owner(engine) for _ in range(3)]
        later = {2: [], 5: []}  # submitted at the 2nd and 5th tokens of the first greedy sequence

        def then(owner: Owner, event: Event) -> None:
            if event.token is not None and later.get(len(owner.tokens)):
                engine.submit(*later.pop(len(owner.tokens)))

        greedy = [Owner(engine, then), Owner(engine), Owner(engine)]  # company: greedy ones joining and leaving
        later[2] += [Sequence(prompt(3, 21), 5, greedy[1], temperature=0.0),
                     Sequence(prompts[1], 12, sampled[1], generator=torch.Generator().manual_seed(8), **SAMPLED[1])]
        later[5] += [Sequence(prompt(9, 22), 9, greedy[2], top_k=1),
                     Sequence(prompts[2], 12, sampled[2], generator=torch.Generator().manual_seed(9), **SAMPLED[2])]
        engine.submit(Sequence(prompt(6, 20), 20, greedy[0], temperature=0.0),
                      Sequence(prompts[0], 12, sampled[0], generator=torch.Generator().manual_seed(7), **SAMPLED[0]))
        for owner in greedy + sampled:
            owner.wait()
        assert max(max(owner.running) for owner in sampled) >= 5  # they did share steps
    assert [owner.tokens for owner in sampled] == wanted
    assert wanted[1] != greedy_alone(model, prompts[1], 12)  # sampled, not greedy


# 3. ends: a stop token, max_new_tokens; exactly one end each ---------------------------------------------

def test_stop_ids_and_length_end_each_sequence_once():
    model = build("llama-tiny")
    ids = prompt(6, 32)  # its greedy text varies (a random model's often repeats one token)
    greedy = greedy_alone(model, ids, 16)
    at = next(i for i in range(3, 16) if greedy[i] not in greedy[:i])  # a token first produced at step `at`
    never = next(t for t in range(4, VOCAB) if t not in greedy)
    partner_ids = prompt(8, 31)
    with engine_of(model) as engine:
        owners = {key: Owner(engine) for key in ("stop", "first", "length", "partner")}
        sequences = {
            "partner": Sequence(partner_ids, 24, owners["partner"], temperature=0.0, logits=[]),
            "stop": Sequence(ids, 16, owners["stop"], temperature=0.0, stop_ids=(never, greedy[at]), logits=[]),
            "first": Sequence(ids, 16, owners["first"], temperature=0.0, stop_ids=(greedy[0],)),
            "length": Sequence(ids, 10, owners["length"], temperature=0.0, stop_ids=(never,), logits=[]),
        }
        engine.submit(*sequences.values())
        for owner in owners.values():
            owner.wait()
        assert engine.steps > 0
    assert owners["stop"].tokens == greedy[: at + 1] and owners["stop"].ends == ["stop"]
    assert owners["first"].tokens == greedy[:1] and owners["first"].ends == ["stop"]  # its prompt's token
    assert owners["length"].tokens == greedy[:10] and owners["length"].ends == ["length"]
    assert owners["partner"].tokens == greedy_alone(model, partner_ids, 24)
    for key, owner in owners.items():
        assert owner.events[-1].finish is not None and len(owner.ends) == 1, key
        assert sequences[key].new == len(owner.tokens)
    for key in ("stop", "length", "partner"):  # rows moved as the others left
        assert_alone(model, sequences[key], owners[key])


# 4. cancellation ------------------------------------------------------------------------------------------

def test_a_cancelled_sequence_leaves_and_the_others_keep_their_logits():
    model = build("llama-tiny")
    at_three, go = threading.Event(), threading.Event()

    def hold(owner: Owner, event: Event) -> None:  # the engine waits inside the 3rd token's event
        if event.token is not None and len(owner.tokens) == 3:
            at_three.set()
            go.wait(TIMEOUT)

    with engine_of(model) as engine:
        first, middle, last = Owner(engine), Owner(engine, hold), Owner(engine)
        sequences = [Sequence(prompt(4, 40), 30, first, temperature=0.0, logits=[]),
                     Sequence(prompt(7, 41), 30, middle, temperature=0.0, logits=[]),
                     Sequence(prompt(2, 42), 30, last, temperature=0.0, logits=[])]
        engine.submit(*sequences)  # rows 0, 1, 2: the middle one leaves, the last one takes its row
        assert at_three.wait(TIMEOUT)
        assert len(engine.running) == 3
        engine.cancel(sequences[1])
        go.set()
        deadline = time.monotonic() + TIMEOUT
        while len(engine.running) == 3 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(engine.running) < 3
        for owner in (first, middle, last):
            owner.wait()
        assert engine.steps > 0
    assert middle.tokens == greedy_alone(model, sequences[1].ids, 3) and middle.ends == ["cancelled"]
    assert middle.running[-1] == 2  # it heard its end once out of the batch
    for sequence, owner in ((sequences[0], first), (sequences[2], last)):
        assert owner.ends == ["length"] and len(owner.tokens) == 30
        assert owner.tokens == greedy_alone(model, sequence.ids, 30)
        assert_alone(model, sequence, owner)
        assert 2 in owner.running[3:]  # they ran on as two rows


def test_a_waiting_sequence_cancelled_never_runs():
    model = build("llama-tiny")
    with engine_of(model) as engine:
        waiting, runs = Owner(engine), Owner(engine)
        with stalled(engine):
            sequence = Sequence(prompt(5, 43), 8, waiting, temperature=0.0)
            engine.submit(sequence, Sequence(prompt(5, 44), 8, runs, temperature=0.0))
            assert len(engine) == 2
            engine.cancel(sequence)
        waiting.wait()
        runs.wait()
    assert waiting.tokens == [] and waiting.ends == ["cancelled"]
    assert runs.ends == ["length"] and len(runs.tokens) == 8


# 5. admission: max_sequences, max_tokens, max_queue; what could never run is refused ---------------------

def run_together(engine: Engine, plan: list[tuple[list[int], int]]):
    """The sequences of ``plan`` submitted together; (owners, heard, held) once all ended: ``heard``
    every (sequence, event) in the order told, ``held`` the prompt and new tokens running at each."""
    heard, held = [], []

    def then(owner: Owner, event: Event) -> None:
        held.append(sum(s.tokens for s in engine.running))
        heard.append((owners.index(owner), event))

    owners = [Owner(engine, then) for _ in plan]
    sequences = [Sequence(ids, n, owner, temperature=0.0) for (ids, n), owner in zip(plan, owners)]
    with stalled(engine):  # all of them wait, then are admitted as room is made
        engine.submit(*sequences)
    for owner in owners:
        owner.wait()
    return owners, heard, held


def test_at_most_max_sequences_run_at_once():
    model = build("llama-tiny")
    plan = [(prompt(3 + i, 50 + i), 4 + 3 * i) for i in range(4)]
    with engine_of(model, max_sequences=2) as engine:
        owners, heard, _ = run_together(engine, plan)
    for (ids, n), owner in zip(plan, owners):
        assert owner.ends == ["length"] and owner.tokens == greedy_alone(model, ids, n)
    assert max(max(owner.running) for owner in owners) == 2
    # first come, first served: 2 takes the place of 0 (the shortest), 3 that of 1
    ends = [i for i, event in heard if event.finish is not None]
    starts = [next(at for at, (j, _) in enumerate(heard) if j == i) for i in range(4)]
    assert ends[:2] == [0, 1] and starts[0] < starts[1] < starts[2] < starts[3]
    assert starts[2] > heard.index((0, owners[0].events[-1])) and starts[3] > heard.index((1, owners[1].events[-1]))


def test_at_most_max_tokens_are_in_flight():
    model = build("llama-tiny")
    plan = [(prompt(5, 60 + i), 10) for i in range(4)]  # 15 tokens each: 40 hold two of them, not three
    with engine_of(model, max_tokens=40) as engine:
        owners, _, held = run_together(engine, plan)
    assert max(held) == 30
    assert max(max(owner.running) for owner in owners) == 2
    for (ids, n), owner in zip(plan, owners):
        assert owner.ends == ["length"] and owner.tokens == greedy_alone(model, ids, n)


def test_what_could_never_run_is_refused_in_one_line():
    model = build("gpt-tiny")  # learned positions: max_positions 256
    assert model.cfg.max_positions == 256
    with engine_of(model, max_tokens=400) as engine:
        with pytest.raises(AtencionError, match=r"15 prompt tokens and 400 new ones are 415, more than the 400"):
            engine.submit(Sequence(prompt(15, 70), 400, Owner()))
        with pytest.raises(AtencionError, match=r"200 prompt tokens and 100 new ones are 300, more than this "
                                                r"model's 256 positions \(max_positions\)"):
            engine.submit(Sequence(prompt(200, 71), 100, Owner()))
        # all or none: a refused sequence keeps its fellows out too
        refused_with = Owner(engine)
        with stalled(engine):
            with pytest.raises(AtencionError, match="300"):
                engine.submit(Sequence(prompt(3, 72), 4, refused_with), Sequence(prompt(200, 71), 100, Owner()))
            assert len(engine) == 0
        # the last position fits: 250 prompt tokens and 6 new ones read positions 0 … 254, in company
        edge, company = Owner(engine), Owner(engine)
        sequences = [Sequence(prompt(250, 73), 6, edge, temperature=0.0, logits=[]),
                     Sequence(prompt(4, 74), 12, company, temperature=0.0, logits=[])]
        engine.submit(*sequences)
        edge.wait()
        company.wait()
        assert engine.steps > 0
    assert refused_with.events == []
    for sequence, owner in zip(sequences, (edge, company)):
        assert owner.ends == ["length"]
        assert_alone(model, sequence, owner)
        assert owner.tokens == greedy_alone(model, sequence.ids, sequence.max_new_tokens)


def test_a_prefix_tuned_model_refuses_what_passes_its_positions(tmp_path):
    model = build("gpt-tiny")
    apply_virtual(model, PrefixSpec(length=3), tmp_path, "0" * 64)  # 3 places before the tokens' positions
    model.eval()
    with engine_of(model) as engine:
        edge, company = Owner(engine), Owner(engine)
        with stalled(engine):
            engine.submit(Sequence(prompt(4, 75), 12, company, temperature=0.0))
            with pytest.raises(AtencionError, match="256"):  # 3 + 250 + 6 − 1 positions: one too many
                engine.submit(Sequence(prompt(250, 76), 6, edge, temperature=0.0))
        company.wait()
    assert company.ends == ["length"]


def test_queue_full_beyond_max_queue():
    model = build("llama-tiny")
    with engine_of(model, max_queue=2) as engine:
        owners = [Owner(engine) for _ in range(4)]
        sequences = [Sequence(prompt(3, 80 + i), 3, owner, temperature=0.0) for i, owner in enumerate(owners)]
        with stalled(engine):
            engine.submit(sequences[0])
            with pytest.raises(QueueFull, match="2 requests waiting"):
                engine.submit(sequences[1], sequences[2])  # together: neither is queued
            assert len(engine) == 1
            engine.submit(sequences[1])
            with pytest.raises(QueueFull):
                engine.submit(sequences[2])
            with pytest.raises(QueueFull):
                asyncio.run(engine.run(lambda: "never", TIMEOUT))
            assert len(engine) == 2
        for owner in owners[:2]:
            owner.wait()
        engine.submit(sequences[2])  # room again
        owners[2].wait()
    assert [owner.ends for owner in owners] == [["length"]] * 3 + [[]]
    assert all(len(owner.tokens) == 3 for owner in owners[:3])


# 6. log-probabilities -------------------------------------------------------------------------------------

def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def assert_top(top: list[tuple[int, float]], logprobs: torch.Tensor, k: int) -> None:
    assert len(top) == k
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    want = logprobs.topk(k)
    assert torch.allclose(torch.tensor(values), want.values, atol=TOLERANCE)
    for token, value in top:
        assert abs(value - float(logprobs[token])) <= TOLERANCE


@pytest.mark.parametrize("name", ["llama-gqa", "gpt-learned", "llama-alibi"])
def test_prompt_logprobs_are_those_of_the_full_forward_pass(name):
    preset, overrides, _ = MODELS[name]
    model = build(preset, **overrides)
    ids, scored_ids = prompt(5, 90), prompt(9, 91)
    with engine_of(model) as engine:
        company, only_prompt, scored = Owner(engine), Owner(engine), Owner(engine)
        engine.submit(Sequence(ids, 20, company, temperature=0.0))
        engine.submit(Sequence(scored_ids, 0, only_prompt, prompt_logprobs=3),
                      Sequence(scored_ids, 6, scored, temperature=0.0, prompt_logprobs=0, logprobs=None))
        for owner in (company, only_prompt, scored):
            owner.wait()
    logprobs = full_logprobs(model, scored_ids)
    assert len(only_prompt.events) == 2 and only_prompt.events[1].finish == "length"
    entries = only_prompt.events[0].prompt
    assert entries is not None and len(entries) == len(scored_ids)
    assert entries[0] == (None, [])
    for i in range(1, len(scored_ids)):
        value, top = entries[i]
        assert abs(value - float(logprobs[i - 1, scored_ids[i]])) <= TOLERANCE
        assert_top(top, logprobs[i - 1], 3)
    assert scored.events[0].prompt is not None and [top for _, top in scored.events[0].prompt] == [[]] * 9
    assert [v for v, _ in scored.events[0].prompt][1:] == pytest.approx([v for v, _ in entries][1:], abs=TOLERANCE)
    assert scored.tokens == greedy_alone(model, scored_ids, 6) and scored.ends == ["length"]
    assert all(e.logprob is None and e.top is None for e in scored.events[1:])
    assert company.tokens == greedy_alone(model, ids, 20)


@pytest.mark.parametrize("k", [0, 1, 5])
def test_token_logprobs_are_log_softmax_of_their_logits(k):
    model = build("llama-tiny")
    with engine_of(model) as engine:
        greedy, sampled = Owner(engine), Owner(engine)
        sequences = [Sequence(prompt(4, 100), 10, greedy, temperature=0.0, logprobs=k, logits=[]),
                     Sequence(prompt(6, 101), 10, sampled, temperature=1.0, logprobs=k, logits=[],
                              generator=torch.Generator().manual_seed(3))]
        engine.submit(*sequences)
        greedy.wait()
        sampled.wait()
        assert engine.steps > 0
    for sequence, owner in zip(sequences, (greedy, sampled)):
        events = [e for e in owner.events if e.token is not None]
        assert len(events) == 10 == len(sequence.logits)
        for event, logits in zip(events, sequence.logits):
            logprobs = logits.log_softmax(-1)
            assert abs(event.logprob - float(logprobs[event.token])) <= TOLERANCE
            assert_top(event.top, logprobs, k)
        assert_alone(model, sequence, owner)
    if k:
        assert all(e.top[0][0] == e.token for e in greedy.events if e.token is not None)


# 7. other work on the model's thread ---------------------------------------------------------------------

def test_run_returns_the_result_and_raises_the_error_of_the_work():
    model = build("llama-tiny")
    with engine_of(model, name="tiny") as engine:
        assert asyncio.run(engine.run(lambda: (threading.current_thread().name, 42), TIMEOUT)) == ("engine-tiny", 42)

        def fails():
            raise ValueError("the work failed")

        with pytest.raises(ValueError, match="the work failed"):
            asyncio.run(engine.run(fails, TIMEOUT))
        release = threading.Event()

        async def late():  # one loop: the work ends, and tells it, after the timeout and before the loop closes
            with pytest.raises(asyncio.TimeoutError):
                await engine.run(lambda: release.wait(TIMEOUT), 0.05)
            release.set()
            return await engine.run(lambda: "after", TIMEOUT)

        assert asyncio.run(late()) == "after"
        # between two steps of a running sequence
        owner = Owner(engine)
        engine.submit(Sequence(prompt(4, 110), 40, owner, temperature=0.0))
        tokens = asyncio.run(engine.run(lambda: len(owner.tokens), TIMEOUT))
        owner.wait()
    assert 0 <= tokens <= 40 and owner.ends == ["length"] and len(owner.tokens) == 40


def test_work_that_outlives_its_closed_loop_leaves_the_engine_serving():
    model = build("llama-tiny")
    with engine_of(model) as engine:
        release, ended = threading.Event(), threading.Event()

        def work():
            release.wait(TIMEOUT)
            ended.set()

        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(engine.run(work, 0.05))  # the loop closes; the work still runs
        release.set()
        assert ended.wait(TIMEOUT)
        engine._thread.join(0.5)  # (at once where the engine's thread ends)
        assert engine._thread.is_alive()
        owner = Owner(engine)
        engine.submit(Sequence(prompt(4, 115), 3, owner, temperature=0.0))
        assert owner.done.wait(5) and owner.ends == ["length"]


def test_stop_finishes_what_waits():
    model = build("llama-tiny")
    engine = Engine(model)
    owners = [Owner(engine) for _ in range(2)]
    engine.submit(*[Sequence(prompt(3, 120 + i), 5, owner, temperature=0.0) for i, owner in enumerate(owners)])
    engine.stop(TIMEOUT)
    assert [owner.ends for owner in owners] == [["length"], ["length"]]
    assert not engine._thread.is_alive()


# 8. a failing step -------------------------------------------------------------------------------------

def test_a_failing_step_ends_every_running_sequence_and_the_engine_serves_on(monkeypatch):
    model = build("llama-tiny")
    real, calls = continuous.batch_step, []

    def fails_on_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the step failed")
        return real(*args)

    monkeypatch.setattr(continuous, "batch_step", fails_on_the_third)
    monkeypatch.setattr(continuous.Engine, "_kernel_plan", lambda self, rows: None)  # (the step batch_step takes)
    with engine_of(model, max_sequences=3) as engine:
        owners = [Owner(engine) for _ in range(3)]
        waiting, waiting_ids = Owner(engine), prompt(4, 134)  # no room for it: it waits while the others fail
        engine.submit(*[Sequence(prompt(3 + i, 130 + i), 20, owner, temperature=0.0)
                        for i, owner in enumerate(owners)], Sequence(waiting_ids, 7, waiting, temperature=0.0))
        for owner in owners + [waiting]:
            owner.wait()
        assert engine.running == []
        later, ids = Owner(engine), prompt(5, 135)
        sequence = Sequence(ids, 8, later, temperature=0.0, logits=[])
        company = Owner(engine)
        engine.submit(sequence, Sequence(prompt(2, 136), 6, company, temperature=0.0))
        later.wait()
        company.wait()
    assert len(calls) > 3  # the later requests took the batched step again
    for owner in owners:
        assert owner.ends == ["error"]
        assert isinstance(owner.events[-1].error, RuntimeError) and len(owner.tokens) == 3
    assert waiting.ends == ["length"] and waiting.tokens == greedy_alone(model, waiting_ids, 7)
    assert waiting.running[0] == 1  # it ran once the others had gone
    assert later.ends == ["length"] and later.tokens == greedy_alone(model, ids, 8)
    assert_alone(model, sequence, later)


def test_a_sequence_that_ended_in_a_failing_turn_hears_one_end(monkeypatch):
    model = build("llama-tiny")

    def fails(*args):
        raise RuntimeError("the step failed")

    monkeypatch.setattr(continuous, "batch_step", fails)
    monkeypatch.setattr(continuous.Engine, "_kernel_plan", lambda self, rows: None)
    with engine_of(model) as engine:
        owners = [Owner(engine) for _ in range(3)]
        with stalled(engine):  # all three join in one turn; the middle one ends at once (max_new_tokens 0)
            engine.submit(Sequence(prompt(3, 140), 5, owners[0], temperature=0.0),
                          Sequence(prompt(3, 141), 0, owners[1], temperature=0.0),
                          Sequence(prompt(3, 142), 5, owners[2], temperature=0.0))
        for owner in owners:
            owner.wait()
        asyncio.run(engine.run(lambda: None, TIMEOUT))  # the turn is over: every event has been told
    assert [owner.ends for owner in owners] == [["error"], ["length"], ["error"]]
