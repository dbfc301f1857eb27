"""`atencion serve`'s log-probabilities, as EleutherAI's lm-evaluation-harness reads them: its
``local-completions`` model (the harness's own OpenAI client, which scores each choice from
``echo`` + ``logprobs`` of /v1/completions on token ids) against a server on a free loopback port,
and its ``hf`` model (transformers, in this process) on the same Hugging Face directory (a Llama
and a Qwen2 with random weights, tests/test_hf_dirs.py), on the tasks of tests/data/lm_eval/: a
multiple-choice task gets the same accuracy from both, and every choice of every sample the same
log-likelihood (within 1e-4) and the same "is greedy", sent one prompt at a time or 8 per request
and 4 requests at once; the hf model's greedy tokens are greedy through the server too; a generation
task gets the same greedy texts. A server whose prompt log-probabilities are off by one position
is caught. Offline: local directories and data files only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")
yaml = pytest.importorskip("yaml")
for _module in ("aiohttp", "requests", "tenacity"):  # what lm-eval's API models need (lm-eval[api])
    pytest.importorskip(_module)


from atencion.decode import continuous  # noqa: E402
from test_hf_dirs import save_llama_dir  # noqa: E402
from test_openai_serve import serving  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
MC, GEN = "atencion_tiny_mc", "atencion_tiny_gen"
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def offline():
    """No network: the hub and datasets offline (also where they read the environment at import)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        import datasets.config
        import huggingface_hub.constants

        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory, offline):
    """The YAMLs of tests/data/lm_eval/, copied with their data files' absolute paths (and a
    datasets cache of the test's own), so that they load from any working directory."""
    work = tmp_path_factory.mktemp("lm_eval_tasks")
    for path in DATA.glob("*.yaml"):
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
        kwargs = config["dataset_kwargs"]
        kwargs["data_files"] = {split: str(DATA / name) for split, name in kwargs["data_files"].items()}
        kwargs["cache_dir"] = str(work / "cache")
        (work / path.name).write_text(yaml.safe_dump(config), encoding="utf-8")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(work), include_defaults=False)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory) -> Path:
    return save_llama_dir(request.param, tmp_path_factory.mktemp("lm_eval") / request.param)


@pytest.fixture(scope="module")
def server(model_dir):
    """`atencion serve` of ``model_dir`` as model "m", in a thread of this process; its URL."""
    with serving([f"m={model_dir}"]) as (url, _):
        yield url


def served_args(url: str, model_dir: Path) -> dict:
    """lm-eval's local-completions on the server: token ids sent (the directory's own tokenizer,
    a local path), each starting with <s> as the hf model's do, one request at a time."""
    return {"model": "m", "base_url": f"{url}/v1/completions", "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "add_bos_token": True,
            "max_length": 64, "batch_size": 1, "num_concurrent": 1, "max_retries": 1, "timeout": 60}


def hf_args(model_dir: Path) -> dict:
    return {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu", "add_bos_token": True,
            "batch_size": 1}


def evaluate(model: str, model_args: dict, task_manager, tasks: list[str], limit=None) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=task_manager,
                                   log_samples=True, limit=limit, bootstrap_iters=0, random_seed=0)


@pytest.fixture(scope="module")
def runs(server, model_dir, task_manager) -> dict[str, dict]:
    """Both of lm-eval's models on both tasks, once per directory."""
    return {"served": evaluate("local-completions", served_args(server, model_dir), task_manager, [MC, GEN]),
            "hf": evaluate("hf", hf_args(model_dir), task_manager, [MC, GEN])}


def by_doc(run: dict, task: str) -> dict[int, dict]:
    return {sample["doc_id"]: sample for sample in run["samples"][task]}


def loglikelihoods(sample: dict) -> list[tuple[float, bool]]:
    """A multiple-choice sample's (log-likelihood, is greedy) of each choice, from ``resps`` (one
    list per request) checked against ``filtered_resps``."""
    raw = [(float(r[0][0]), bool(r[0][1])) for r in sample["resps"]]
    assert [(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]] == raw
    return raw


def test_local_completions_on_the_server_gives_the_hf_model_s_accuracy_and_log_likelihoods(runs):
    """Every choice of every sample: the same log-likelihood within 1e-4 and the same is-greedy, so the same
    accuracy; the log-likelihoods are finite, negative and tell the choices apart (a random model, but not a
    constant one)."""
    served, hf = by_doc(runs["served"], MC), by_doc(runs["hf"], MC)
    assert sorted(served) == sorted(hf) == list(range(30))
    spread = []
    for doc_id in served:
        ours, theirs = loglikelihoods(served[doc_id]), loglikelihoods(hf[doc_id])
        assert len(ours) == len(theirs) == len(served[doc_id]["doc"]["choices"])
        for (ll, greedy), (hf_ll, hf_greedy) in zip(ours, theirs):
            assert math.isfinite(ll) and ll < 0
            assert abs(ll - hf_ll) <= TOLERANCE, (doc_id, ours, theirs)
            assert greedy == hf_greedy, (doc_id, ours, theirs)
        assert served[doc_id]["acc"] == hf[doc_id]["acc"] and served[doc_id]["acc_norm"] == hf[doc_id]["acc_norm"]
        spread.append(max(ll for ll, _ in ours) - min(ll for ll, _ in ours))
    assert min(spread) > 0.01
    for metric in ("acc,none", "acc_norm,none"):
        assert runs["served"]["results"][MC][metric] == runs["hf"]["results"][MC][metric]


def test_local_completions_on_the_server_gives_the_hf_model_s_greedy_generations(runs):
    """generate_until at temperature 0, until a newline or 8 tokens: the same text for every prompt."""
    served, hf = by_doc(runs["served"], GEN), by_doc(runs["hf"], GEN)
    assert sorted(served) == sorted(hf) == list(range(5))
    for doc_id in served:
        assert served[doc_id]["resps"] == hf[doc_id]["resps"], doc_id
        assert served[doc_id]["filtered_resps"] == hf[doc_id]["filtered_resps"], doc_id
    assert any(sample["resps"][0][0] for sample in served.values())  # not all empty
    assert runs["served"]["results"][GEN]["exact_match,none"] == runs["hf"]["results"][GEN]["exact_match,none"]


def test_batched_and_concurrent_requests_give_the_same_log_likelihoods(runs, server, model_dir, task_manager):
    """lm-eval sending 8 prompts per request (a list of token-id lists) and 4 requests at once (its
    asynchronous client; the server's continuous batching): every choice's log-likelihood as the hf model's."""
    args = {**served_args(server, model_dir), "batch_size": 8, "num_concurrent": 4}
    batched, hf = by_doc(evaluate("local-completions", args, task_manager, [MC]), MC), by_doc(runs["hf"], MC)
    assert sorted(batched) == sorted(hf)
    for doc_id in batched:
        for (ll, greedy), (hf_ll, hf_greedy) in zip(loglikelihoods(batched[doc_id]), loglikelihoods(hf[doc_id])):
            assert abs(ll - hf_ll) <= TOLERANCE and greedy == hf_greedy, doc_id


def test_the_hf_model_s_greedy_tokens_are_greedy_through_the_server(server, model_dir, offline):
    """is_greedy, which local-completions reads from top_logprobs (each scored token against the most likely
    one): True for the hf model's own greedy continuation, False once its last token is another, on both models
    (the tasks' choices are never greedy for a random model). Through lm-eval's models' token-level entry."""
    from lm_eval.api.registry import get_model

    served = get_model("local-completions")(**served_args(server, model_dir))
    hf = get_model("hf")(**hf_args(model_dir))
    context = hf.tok_encode("the cat sat on")
    assert context[0] == hf.tokenizer.bos_token_id
    greedy = []
    with torch.no_grad():
        for _ in range(4):
            greedy.append(int(hf.model(torch.tensor([context + greedy])).logits[0, -1].argmax()))
    other = greedy[:-1] + [(greedy[-1] + 1) % len(hf.tokenizer)]
    requests = [(("the cat sat on", "greedy"), context, greedy), (("the cat sat on", "other"), context, other)]
    ours, theirs = served._loglikelihood_tokens(requests), hf._loglikelihood_tokens(requests)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs] == [True, False]
    for (ll, _), (hf_ll, _) in zip(ours, theirs):
        assert abs(ll - hf_ll) <= TOLERANCE


def test_a_server_whose_prompt_log_probabilities_are_off_by_one_is_caught(runs, server, model_dir, task_manager,
                                                                          monkeypatch):
    """The comparison has teeth: each prompt token scored by the logits at its own position (not the one
    before) gives log-likelihoods that differ from the hf model's by more than the tolerance."""
    right = continuous._prompt_logprobs

    def off_by_one(logits, ids, count):  # token i scored by row i of the logits, which predicts token i + 1
        return right(logits[1:], ids, count)

    monkeypatch.setattr(continuous, "_prompt_logprobs", off_by_one)
    wrong = by_doc(evaluate("local-completions", served_args(server, model_dir), task_manager, [MC], limit=3), MC)
    hf = by_doc(runs["hf"], MC)
    gaps = [abs(ll - hf_ll) for doc_id in wrong
            for (ll, _), (hf_ll, _) in zip(loglikelihoods(wrong[doc_id]), loglikelihoods(hf[doc_id]))]
    assert len(gaps) >= 9 and max(gaps) > 100 * TOLERANCE
