"""LRA's ListOps: the generator's trees keep to the recipe and evaluate to their labels (by a
reader written here), the splits are reproducible and disjoint; the whitespace tokenizer; a
classifier trained, evaluated and used on ListOps through the command line, 2,000 tokens long."""

from __future__ import annotations

import json
import logging
import random
import statistics

import pytest

from atencion.cli import main
from atencion.data.listops import ListOpsRecipe, draw_examples, write_listops, write_prefixes
from atencion.data.listops import main as listops_main
from atencion.data.tokenizer import SPECIALS, UNK_ID, Tokenizer
from atencion.errors import AtencionError
from atencion.tasks.base import warn_unseen
from atencion.tasks.classify import ClassifyTask
from atencion.train.config import load_config

SMALL = ListOpsRecipe(min_length=5, max_length=25, max_depth=4, max_args=4)
READ = {"[MIN": min, "[MAX": max, "[MED": lambda xs: int(statistics.median(xs)), "[SM": lambda xs: sum(xs) % 10}


def read_tree(text: str) -> tuple[int, int, list[int]]:
    """The value of a ListOps text, its depth (a digit at the top is depth 1, as LRA counts) and
    the number of arguments of each operator: a stack reader that knows only the task's
    definition (MED is Python's statistics.median, made an integer)."""
    stack: list[tuple[str, list[int]]] = []
    value, depth, arities = None, 0, []
    for token in text.split(" "):
        if token in READ:
            stack.append((token, []))
            continue
        if token == "]":
            operator, args = stack.pop()
            arities.append(len(args))
            token_value = READ[operator](args)
        else:
            assert token in [str(d) for d in range(10)], token
            token_value = int(token)
            depth = max(depth, len(stack) + 1)
        if stack:
            stack[-1][1].append(token_value)
        else:
            assert value is None, "one expression per text"
            value = token_value
    assert not stack and value is not None
    return value, depth, arities


def test_lras_trees_evaluate_to_their_labels_and_keep_to_the_recipe():
    recipe = ListOpsRecipe()
    examples = list(draw_examples(60, random.Random(3), recipe, set()))
    for label, text in examples:
        value, depth, arities = read_tree(text)
        assert value == label
        assert recipe.min_length < len(text.split(" ")) < recipe.max_length
        assert depth <= recipe.max_depth and all(2 <= n <= recipe.max_args for n in arities)
    assert {label for label, _ in examples} == set(range(10))  # every digit comes out


def test_small_recipes_reach_their_bounds_and_never_pass_them():
    examples = list(draw_examples(400, random.Random(0), SMALL, set()))
    lengths, depths, arities = [], [], []
    for label, text in examples:
        value, depth, args = read_tree(text)
        assert value == label
        lengths.append(len(text.split(" ")))
        depths.append(depth)
        arities += args
    assert min(lengths) == SMALL.min_length + 1 and max(lengths) == SMALL.max_length - 1  # LRA's strict bounds
    assert max(depths) == SMALL.max_depth and min(arities) == 2 and max(arities) == SMALL.max_args
    assert {text.split(" ")[0] for _, text in examples} == {"[MIN", "[MAX", "[MED", "[SM"}
    assert len({text for _, text in examples}) == len(examples)  # each text once


def test_the_median_of_an_even_count_is_the_mean_of_the_middle_two_rounded_down():
    examples = list(draw_examples(300, random.Random(1), SMALL, set()))
    evens = [t for _, t in examples if t.startswith("[MED") and (len(t.split(" ")) - 2) % 2 == 0
             and "[" not in t[1:]]  # a flat MED of an even count
    assert evens
    for text in evens:
        args = sorted(int(x) for x in text.split(" ")[1:-1])
        middle = len(args) // 2
        assert read_tree(text)[0] == (args[middle - 1] + args[middle]) // 2


def files(out) -> dict[str, str]:
    return {split: (out / f"{split}.tsv").read_text(encoding="utf-8") for split in ("train", "valid", "test")}


def test_the_splits_come_from_the_seed_alone_each_from_a_stream_of_its_own(tmp_path):
    sizes = {"train": 40, "valid": 10, "test": 10}
    first = write_listops(tmp_path / "a", sizes, seed=5, recipe=SMALL, progress=False)
    write_listops(tmp_path / "b", sizes, seed=5, recipe=SMALL, progress=False)
    write_listops(tmp_path / "c", {**sizes, "train": 25}, seed=5, recipe=SMALL, progress=False)
    write_listops(tmp_path / "d", sizes, seed=6, recipe=SMALL, progress=False)
    a, b, c, d = (files(tmp_path / x) for x in "abcd")
    assert a == b  # the same seed, the same files, byte for byte
    assert c["valid"] == a["valid"] and c["test"] == a["test"]  # --train does not move them
    assert c["train"] == "".join(a["train"].splitlines(keepends=True)[:25])
    assert all(d[s] != a[s] for s in a)  # another seed, other files
    texts = {s: {row.split("\t")[1] for row in a[s].splitlines()} for s in a}
    assert not (texts["train"] & texts["valid"] or texts["train"] & texts["test"] or texts["valid"] & texts["test"])
    assert [len(a[s].splitlines()) for s in a] == [40, 10, 10]
    labels = first["train"]["labels"]
    assert sum(labels) == 40 and first["train"]["majority_share"] == max(labels) / 40


def listops_command(args: list[str]) -> int:
    """``python -m atencion.data.listops ARGS``'s exit status (argparse's refusals exit)."""
    try:
        return listops_main(args)
    except SystemExit as done:
        return done.code


def test_the_command_refuses_bad_arguments_in_one_line_and_never_overwrites(tmp_path, capsys):
    out = tmp_path / "data"
    small = ["--train", "5", "--valid", "2", "--test", "2", "--min-length", "5", "--max-length", "40"]
    assert listops_command([str(out), *small]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["train"]["examples"] == 5 and report["min_length"] == 5
    before = files(out)
    for bad, words in ((["--train", "0"], "--train must be an integer >= 1"),
                       (["--min-length", "10", "--max-length", "11"], "--max-length must be at least"),
                       (["--max-args", "1"], "--max-args must be"), (["--seed", "x"], "invalid int value"),
                       ([], "train.tsv: exists; nothing was overwritten (--force replaces it)")):
        assert listops_command([str(out), *small, *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert files(out) == before
    assert listops_command([str(out), *small, "--seed", "1", "--force"]) == 0
    assert files(out) != before


def test_prefixes_cut_each_example_to_its_first_symbols_and_keep_its_label(tmp_path, capsys):
    out = tmp_path / "data"
    small = ["--train", "6", "--valid", "3", "--test", "2", "--min-length", "12", "--max-length", "40"]
    assert listops_command([str(out), *small, "--prefixes", "5"]) == 0  # the splits, then their prefixes
    assert json.loads(capsys.readouterr().out)["prefixes"]["train"] == 6
    for split in ("train", "valid"):
        whole = [row.split("\t") for row in (out / f"{split}.tsv").read_text().splitlines()]
        cut = [row.split("\t") for row in (out / "prefix5" / f"{split}.tsv").read_text().splitlines()]
        assert [label for label, _ in cut] == [label for label, _ in whole]
        assert [text.split(" ") for _, text in cut] == [text.split(" ")[:5] for _, text in whole]
    assert not (out / "prefix5" / "test.tsv").exists()  # the test set is read whole, never cut
    splits = files(out)
    assert listops_command([str(out), "--prefixes", "7"]) == 0  # on the splits there, left as they are
    assert files(out) == splits and (out / "prefix7" / "train.tsv").is_file()
    before = files(out)
    for bad, words in ((["--prefixes", "5"], "prefix5/train.tsv: exists; nothing was overwritten"),
                       (["--prefixes", "0"], "--prefixes must be an integer >= 1")):
        assert listops_command([str(out), *bad]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err
    assert files(out) == before
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train.tsv").write_text("3\t[MAX 1 3 ]\nno tab here\n")
    (tmp_path / "bad" / "valid.tsv").write_text("3\t[MAX 1 3 ]\n")
    with pytest.raises(AtencionError, match=r"train.tsv, line 2: expected label<TAB>text"):
        write_prefixes(tmp_path / "bad", 2)
    assert not (tmp_path / "bad" / "prefix2").exists()


def test_bounds_no_tree_meets_are_refused_not_searched_forever():
    impossible = ListOpsRecipe(min_length=1, max_length=4)  # a digit has 1 token, an operator at least 4
    with pytest.raises(AtencionError, match="no new tree of more than 1 and fewer than 4 tokens in 2,000 draws"):
        list(draw_examples(3, random.Random(0), impossible, set(), patience=2000))
    digits = ListOpsRecipe(min_length=0, max_length=2)  # ten distinct texts in all
    with pytest.raises(AtencionError, match=r"after 10 of 11\)"):
        list(draw_examples(11, random.Random(0), digits, set(), patience=2000))


# the whitespace tokenizer ---------------------------------------------------------------------------


def test_a_whitespace_vocabulary_round_trips_symbols_and_is_saved_with_the_model(tmp_path):
    tok = Tokenizer.train_text(["[MAX 4 3 [MIN 2 3 ] 1 ]", "[SM 9 9 ]"], "whitespace")
    assert tok.kind == "whitespace"
    assert tok.vocab_size == len(SPECIALS) + 9  # [MAX [MIN [SM ] 1 2 3 4 9
    ids = tok.encode("[SM  4 [MAX 9 ]\t3 ]")
    assert len(ids) == 7 and UNK_ID not in ids and tok.decode(ids) == "[SM 4 [MAX 9 ] 3 ]"
    assert tok.encode("[MED 7 <s> </s> ]") == [UNK_ID] * 4 + [tok.src.piece_to_id("]")]  # unseen; specials' names
    tok.save(tmp_path)
    info = json.loads((tmp_path / "tokenizer.json").read_text())
    assert info["kind"] == "whitespace" and info["pieces"][:4] == list(SPECIALS)
    again = Tokenizer.load(tmp_path)
    assert again.kind == "whitespace" and again.encode("[SM 4 [MAX 9 ] 3 ]") == ids
    info["pieces"] = info["pieces"][1:]
    (tmp_path / "tokenizer.json").write_text(json.dumps(info))
    with pytest.raises(AtencionError, match="then distinct symbols"):
        Tokenizer.load(tmp_path)


def test_symbols_a_whitespace_vocabulary_lacks_are_named_once():
    tok = Tokenizer.train_text(["[MAX 1 2 ]"], "whitespace")
    said = []
    warn_unseen(tok, ["[MAX 1 2 ]", "[FIRST 1 7 ]", "[LAST 7 ]"], "--tsv t.tsv", said.append, [2, 3, 4])
    assert said == ["--tsv t.tsv: 3 symbols not in the vocabulary, read as <unk>: '[FIRST', '7', '[LAST' "
                    "(first on line 3)"]


def test_whitespace_is_a_tokenizer_of_the_single_stack_tasks(tmp_path):
    path = tmp_path / "c.yaml"
    for task in ("lm", "mlm", "classify"):
        path.write_text(f"task: {task}\ndata:\n  tokenizer: whitespace\n", encoding="utf-8")
        assert load_config(path).data.tokenizer == "whitespace"
    path.write_text("data:\n  tokenizer: whitespace\n", encoding="utf-8")
    with pytest.raises(AtencionError, match="data.tokenizer: whitespace is for the single-stack tasks"):
        load_config(path)


# a classifier on ListOps -------------------------------------------------------------------------


TINY = ["model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.n_heads=2", "model.dropout=0.0",
        "train.warmup=5", "train.lr_peak=0.003", "train.progress=false", "train.tensorboard=false",
        "train.log_every=1", "train.max_tokens=4096", "train.keep_last=1"]


@pytest.fixture(scope="module")
def listops_data(tmp_path_factory):
    """LRA's recipe as it is (500 to 2,000 tokens), a few examples of each split."""
    out = tmp_path_factory.mktemp("listops") / "data"
    write_listops(out, {"train": 24, "valid": 6, "test": 6}, seed=0, progress=False)
    return out


def test_a_classifier_trains_on_2000_token_listops_and_is_evaluated_and_used_by_the_commands(
        listops_data, tmp_path, capsys):
    config = tmp_path / "listops.yaml"
    config.write_text("task: classify\nmodel:\n  arch: encoder\n  positional: learned\n  max_positions: 2048\n"
                      "  pooling: mean\ndata:\n  tokenizer: whitespace\n  max_len: 2000\n", encoding="utf-8")
    sets = [f"data.train_tsv={listops_data / 'train.tsv'}", f"data.valid_tsv={listops_data / 'valid.tsv'}",
            "train.max_steps=3", "train.valid_every=3", *TINY]
    assert main(["train", str(config), "--out", str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))]) == 0
    capsys.readouterr()
    best = tmp_path / "run" / "best"
    assert json.loads((best / "tokenizer.json").read_text())["kind"] == "whitespace"
    assert json.loads((best / "config.json").read_text())["labels"] == [str(d) for d in range(10)]
    test = listops_data / "test.tsv"
    longest = max(len(row.split("\t")[1].split(" ")) for row in test.read_text().splitlines())
    assert longest > 1024  # beyond the commands' default --max-input-tokens
    assert main(["evaluate", "--model", str(best), "--tsv", str(test)]) == 2  # refused, not cut
    assert "tokens, more than the limit of 1024" in capsys.readouterr().err
    assert main(["evaluate", "--model", str(best), "--tsv", str(test), "--max-input-tokens", "2000"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "classify" and result["sentences"] == 6 and 0 <= result["accuracy"] <= 1
    texts = [row.split("\t")[1] for row in test.read_text().splitlines()] + ["[FIRST 1 2 ]"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert main(["classify", "--model", str(best), "--input", str(tmp_path / "in.txt"),
                 "--max-input-tokens", "2000"]) == 0
    out = capsys.readouterr()
    assert [line.split("\t")[0] in [str(d) for d in range(10)] for line in out.out.splitlines()] == [True] * 7
    assert "1 symbol not in the vocabulary, read as <unk>: '[FIRST' (first on line 7)" in out.err


def test_a_listops_row_longer_than_data_max_len_is_dropped_and_counted(listops_data, tmp_path, caplog):
    lengths = [len(row.split("\t")[1].split(" ")) for row in (listops_data / "train.tsv").read_text().splitlines()]
    limit = sorted(lengths)[len(lengths) // 2]
    path = tmp_path / "c.yaml"
    path.write_text("task: classify\n", encoding="utf-8")
    cfg = load_config(path, [f"data.train_tsv={listops_data / 'train.tsv'}", "data.tokenizer=whitespace",
                             f"data.max_len={limit}", "model.max_positions=2048"])
    task = ClassifyTask(cfg)
    with caplog.at_level(logging.WARNING):
        task.encode(task.train_tokenizer())
    dropped = sum(n > limit for n in lengths)
    assert dropped and len(task.examples) == len(lengths) - dropped
    assert max(len(e) for e in task.examples) <= limit + 2  # <s> and </s>: nothing was cut short
    assert f"dropped {dropped} of {len(lengths)} sentences longer than data.max_len={limit}" in caplog.text


# the configs -----------------------------------------------------------------------------------------

ATTENTION_KEYS = {"full": set(), "flash": {"q_tile", "k_tile"}, "window": {"window"},
                  "longformer": {"window", "global_tokens"},
                  "bigbird": {"block_size", "random_blocks", "global_blocks"},
                  "linformer": {"proj_len", "sharing"}, "performer": {"features", "redraw"}}


def test_the_listops_configs_differ_in_model_attention_alone():
    import yaml

    configs = {kind: yaml.safe_load(open(f"configs/listops_{kind}.yaml")) for kind in ATTENTION_KEYS}
    for kind, raw in configs.items():
        attention = raw["model"].pop("attention", {"kind": "full"})
        assert attention.pop("kind") == kind and set(attention) == ATTENTION_KEYS[kind], kind
        assert raw == configs["full"], kind
    cfg = load_config("configs/listops_full.yaml")
    assert (cfg.task, cfg.data.tokenizer, cfg.data.max_len, cfg.model["max_positions"]) == (
        "classify", "whitespace", 2000, 2048)
