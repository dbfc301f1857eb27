"""ListOps (Nangia & Bowman 2018) as the Long Range Arena builds it (Tay et al. 2021, ListOps
column of Table 1; google-research/long-range-arena, ``lra_benchmarks/data/listops.py``):
nested lists of the digits 0-9 under the operators MIN, MAX, MED (the median, ``int`` of NumPy's:
the mean of the two middle values, rounded down) and SM (the sum modulo 10); the label is the
value of the whole expression, a digit.

    python -m atencion.data.listops runs/listops/data      # train.tsv, valid.tsv, test.tsv

A tree is drawn as LRA's ``generate_tree`` draws it, draw for draw: at depth < max_depth (the
root is depth 1) a node is an operator with probability 0.25, else a digit; an operator takes
2 to max_args arguments, drawn before the operator itself. Trees are drawn until the wanted
number have more than ``min_length`` and fewer than ``max_length`` tokens (LRA's strict bounds),
each distinct: no text is in two splits, or twice in one.

The text is what LRA's model reads, one token per space-separated symbol:
``[MAX 4 3 [MIN 2 3 ] 1 0 [MED 1 5 8 9 2 ] ]``. LRA's generator writes a parenthesis pair
around every (function, argument) step, ``( ( ( [MAX 4 ) 3 ) ... ] )``, which its input
pipeline deletes again before the whitespace tokenizer (since commit c209b2a; the bounds count
the tokens without them), so they are left out here. Each split is drawn from a random stream
of its own, named by the seed and the split, so the validation and test sets do not change
with ``--train``; the files are ``label<TAB>text``, read by ``task: classify`` with
``data.tokenizer: whitespace``.

    python -m atencion.data.listops runs/listops/data --prefixes 32   # and prefix32/train.tsv, valid.tsv

``--prefixes N`` also writes ``prefixN/train.tsv`` and ``valid.tsv``: each example cut to its first
N symbols, its label kept (the splits written first when missing). A classifier trained on them
first, then on the whole examples from there (``train.init_from``), leaves the majority-label
plateau that whole examples hold it on: staged training, short inputs before long ones (Press et
al. 2021, Shortformer; configs/listops_full.yaml gives the two commands).
"""

from __future__ import annotations

import hashlib
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import AtencionError
from ..fileio import atomic_write
from .script import ScriptParser, run_writer

log = logging.getLogger(__name__)

MIN, MAX, MED, SUM_MOD, END = "[MIN", "[MAX", "[MED", "[SM", "]"
OPERATORS = (MIN, MAX, MED, SUM_MOD)  # in LRA's order: random.choice picks by position
VALUES = range(10)
VALUE_P = 0.25                        # below max_depth, a node is an operator with this probability
SPLITS = ("train", "valid", "test")
COUNTED_LENGTH = 4096                 # ListOpsRecipe.distinct_trees counts trees up to this many tokens


@dataclass(frozen=True)
class ListOpsRecipe:
    """LRA's settings: trees of depth at most ``max_depth``, at most ``max_args`` arguments per
    operator, kept when they have more than ``min_length`` and fewer than ``max_length`` tokens."""

    min_length: int = 500
    max_length: int = 2000
    max_depth: int = 10
    max_args: int = 10

    def check(self) -> None:
        """One AtencionError naming the setting that no tree can meet."""
        if self.max_depth < 1:
            raise AtencionError(f"--max-depth must be an integer >= 1, got {self.max_depth}")
        if self.max_args < 2:
            raise AtencionError(f"--max-args must be an integer >= 2, got {self.max_args}")
        if self.min_length < 0:
            raise AtencionError(f"--min-length must be an integer >= 0, got {self.min_length}")
        if self.max_length < self.min_length + 2:
            raise AtencionError(f"--max-length must be at least --min-length + 2 (a tree has more than min and "
                                f"fewer than max tokens), got {self.max_length} with --min-length {self.min_length}")

    def distinct_trees(self) -> int:
        """How many distinct trees (so distinct texts: the text spells the tree) the recipe allows,
        counted by length without drawing one: more examples than this cannot be drawn, each text
        once, and would be searched for until the patience runs out. Exact up to 10^15, where the
        count is saturated (no run asks for so many), and so is a recipe whose trees reach past
        COUNTED_LENGTH tokens: such a tree holds over a thousand digits, each one of ten."""
        import numpy as np

        longest = 1
        for _ in range(self.max_depth - 1):  # the longest tree: every operator with max_args arguments
            longest = min(self.max_args * longest + 2, COUNTED_LENGTH + 1)
        cap, width = 1e15, min(self.max_length, longest + 1)  # lengths 0 … width - 1: no tree is longer
        if width > COUNTED_LENGTH:
            return int(cap)
        leaf = np.zeros(width)
        leaf[1] = len(VALUES)
        trees = leaf  # the trees of one level: a digit
        for _ in range(self.max_depth - 1):  # one level more each time: a digit, or an operator over trees
            rows, lists = trees, np.zeros(width)  # sequences of k subtrees, k = 1, 2, …; their sum over k >= 2
            for _ in range(2, self.max_args + 1):
                rows = np.minimum(np.convolve(rows, trees)[:width], cap)
                lists += rows
            deeper = leaf.copy()
            deeper[2:] += len(OPERATORS) * lists[:-2]  # the operator and the closing bracket: two tokens more
            deeper = np.minimum(deeper, cap)
            if np.array_equal(deeper, trees):  # every length counted in full (or past the cap): no level adds one
                break
            trees = deeper
        return int(trees[self.min_length + 1:self.max_length].sum().clip(max=cap))


def apply(operator: str, args: list[int]) -> int:
    """The value of ``operator`` over its arguments, as LRA's ``to_value`` computes it."""
    if operator == MIN:
        return min(args)
    if operator == MAX:
        return max(args)
    if operator == MED:  # int(np.median(args)): the mean of the middle two of an even count, rounded down
        ordered, middle = sorted(args), len(args) // 2
        return ordered[middle] if len(args) % 2 else (ordered[middle - 1] + ordered[middle]) // 2
    return sum(args) % 10


def draw_tree(rng: random.Random, recipe: ListOpsRecipe, depth: int = 1,
              tokens: list[str] | None = None) -> tuple[list[str], int]:
    """One tree drawn as LRA's ``generate_tree(depth, max_depth, max_args)`` draws it from
    ``rng``: its tokens (appended to ``tokens``) and its value."""
    tokens = [] if tokens is None else tokens
    if (rng.random() if depth < recipe.max_depth else 1.0) > VALUE_P:
        value = rng.choice(VALUES)
        tokens.append(str(value))
        return tokens, value
    at = len(tokens)
    tokens.append("")  # the operator's place: LRA draws it after its arguments
    args = [draw_tree(rng, recipe, depth + 1, tokens)[1] for _ in range(rng.randint(2, recipe.max_args))]
    tokens[at] = operator = rng.choice(OPERATORS)
    tokens.append(END)
    return tokens, apply(operator, args)


def draw_examples(n: int, rng: random.Random, recipe: ListOpsRecipe, seen: set[bytes],
                  patience: int = 1_000_000) -> Iterator[tuple[int, str]]:
    """``n`` examples (label, text) within the recipe's bounds, none whose text is in ``seen``
    (each one's digest is added to it). Refused after ``patience`` trees in a row gave nothing
    new: bounds that no tree, or no new tree, meets."""
    kept = misses = 0
    while kept < n:
        tokens, value = draw_tree(rng, recipe)
        if recipe.min_length < len(tokens) < recipe.max_length:
            text = " ".join(tokens)
            digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
            if digest not in seen:
                seen.add(digest)
                kept, misses = kept + 1, 0
                yield value, text
                continue
        misses += 1
        if misses >= patience:
            raise AtencionError(f"--min-length {recipe.min_length} / --max-length {recipe.max_length}: no new tree "
                                f"of more than {recipe.min_length} and fewer than {recipe.max_length} tokens in "
                                f"{patience:,} draws (after {kept} of {n}); widen the bounds (LRA: 500 and 2000)")


def write_listops(out: str | Path, sizes: dict[str, int] | None = None, seed: int = 0,
                  recipe: ListOpsRecipe = ListOpsRecipe(), force: bool = False, progress: bool = True,
                  patience: int = 1_000_000) -> dict:
    """Write ``out``/train.tsv, valid.tsv and test.tsv (``sizes``: examples per split, LRA's
    96,000 / 2,000 / 2,000 by default) as ``label<TAB>text`` rows, each split drawn from
    ``random.Random("listops SPLIT SEED")``. Existing files are refused unless ``force``; each
    file is written under a temporary name, then renamed. Returns the counts, each split's
    labels and its majority-label share, and the seconds taken."""
    sizes = dict(zip(SPLITS, (96_000, 2_000, 2_000))) if sizes is None else sizes
    recipe.check()
    for split in SPLITS:
        if isinstance(sizes.get(split), bool) or not isinstance(sizes.get(split), int) or sizes[split] < 1:
            raise AtencionError(f"--{split} must be an integer >= 1, got {sizes.get(split)!r}")
    _check_enough_trees(sizes, recipe)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AtencionError(f"{out}: is a file; expected a directory")
    there = [str(out / f"{split}.tsv") for split in SPLITS if (out / f"{split}.tsv").exists()]
    if there and not force:
        raise AtencionError(f"{there[0]}: exists; nothing was overwritten (--force replaces it)")
    out.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    start, seen, report = time.perf_counter(), set(), {"out": str(out), "seed": seed, **vars(recipe)}
    bar = tqdm(total=sum(sizes[s] for s in SPLITS), unit="tree", dynamic_ncols=True, leave=False,
               disable=None if progress else True)
    try:
        for split in SPLITS:
            bar.set_description(f"listops {split}")
            rng = random.Random(f"listops {split} {seed}")
            labels = _write_rows(out / f"{split}.tsv", draw_examples(sizes[split], rng, recipe, seen, patience), bar)
            report[split] = {"examples": sizes[split], "labels": [labels[v] for v in VALUES],
                             "majority_share": round(max(labels.values()) / sizes[split], 4)}
            log.info("listops: wrote %s (%d examples)", out / f"{split}.tsv", sizes[split])
    finally:
        bar.close()
    report["seconds"] = round(time.perf_counter() - start, 1)
    return report


def _check_enough_trees(sizes: dict[str, int], recipe: ListOpsRecipe) -> None:
    """Refuse, in one line, more examples than the recipe has distinct trees (the splits share no
    text): the draws would go on until the patience ran out, an hour or more, for nothing."""
    asked, there = sum(sizes[split] for split in SPLITS), recipe.distinct_trees()
    if asked > there:
        counts = " ".join(f"--{split} {sizes[split]:,}" for split in SPLITS)
        raise AtencionError(f"{counts}: {asked:,} distinct examples asked, but only {there:,} trees have more than "
                            f"{recipe.min_length} and fewer than {recipe.max_length} tokens (--max-depth "
                            f"{recipe.max_depth}, --max-args {recipe.max_args}); ask for fewer or widen "
                            f"--min-length/--max-length")


PREFIX_SPLITS = ("train", "valid")  # what write_prefixes cuts: the test set is read whole


def write_prefixes(data: str | Path, length: int, force: bool = False) -> dict:
    """``data``/prefix``length``/train.tsv and valid.tsv: the rows of ``data``'s train.tsv and
    valid.tsv, each text cut to its first ``length`` symbols, the label kept. Existing files are
    refused unless ``force``. Returns where they are and how many rows each holds."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise AtencionError(f"--prefixes must be an integer >= 1 (symbols kept), got {length!r}")
    data = Path(data)
    out = data / f"prefix{length}"
    there = [str(out / f"{split}.tsv") for split in PREFIX_SPLITS if (out / f"{split}.tsv").exists()]
    if there and not force:
        raise AtencionError(f"{there[0]}: exists; nothing was overwritten (--force replaces it)")
    cuts = {}
    for split in PREFIX_SPLITS:  # both read before anything is written
        source = data / f"{split}.tsv"
        if not source.is_file():
            raise AtencionError(f"{source}: not found; expected the {split} split (label<TAB>text rows)")
        cuts[split] = []
        with source.open(encoding="utf-8") as rows:
            for number, row in enumerate(rows, 1):
                label, tab, text = row.rstrip("\n").partition("\t")
                symbols = text.split()
                if not tab or not symbols:
                    raise AtencionError(f"{source}, line {number}: expected label<TAB>text, got {row[:60]!r}")
                cuts[split].append((label, " ".join(symbols[:length])))
    out.mkdir(parents=True, exist_ok=True)
    for split, cut in cuts.items():
        _write_rows(out / f"{split}.tsv", iter(cut), None)
    return {"out": str(out), "length": length, **{split: len(cut) for split, cut in cuts.items()}}


def _write_rows(path: Path, examples: Iterator[tuple[int, str]], bar) -> Counter[int]:
    """``examples`` written to ``path`` as ``label<TAB>text`` rows (under a temporary name, then
    renamed), each counted on the progress ``bar`` (if any); the count of each label."""
    labels: Counter[int] = Counter()

    def write(tmp: Path) -> None:
        with tmp.open("w", encoding="utf-8") as f:
            for label, text in examples:
                f.write(f"{label}\t{text}\n")
                labels[label] += 1
                if bar is not None:
                    bar.update()

    atomic_write(path, write)
    return labels


def main(argv: list[str] | None = None) -> int:
    """``python -m atencion.data.listops OUT_DIR [...]``: write the splits, print one JSON line."""
    defaults = ListOpsRecipe()
    p = ScriptParser("python -m atencion.data.listops", __doc__)
    p.add_argument("out", metavar="OUT_DIR", help="where train.tsv, valid.tsv and test.tsv are written")
    for split, n in zip(SPLITS, (96_000, 2_000, 2_000)):
        p.add_argument(f"--{split}", type=int, default=n, help=f"{split} examples (default: {n:,})")
    p.add_argument("--seed", type=int, default=0, help="random seed of the three streams (default: 0)")
    for name in ("min_length", "max_length", "max_depth", "max_args"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name),
                       help=f"(default, LRA's: {getattr(defaults, name)})")
    p.add_argument("--prefixes", type=int, metavar="N", help="also write prefixN/train.tsv and valid.tsv: each "
                   "example cut to its first N symbols (the splits are written first only when missing)")
    p.add_argument("--force", action="store_true", help="replace existing files")
    args = p.parse_args(argv)
    recipe = ListOpsRecipe(args.min_length, args.max_length, args.max_depth, args.max_args)
    sizes = {s: getattr(args, s) for s in SPLITS}

    def write() -> dict:
        there = all((Path(args.out) / f"{split}.tsv").is_file() for split in SPLITS)
        if args.prefixes is None or not there or args.force:
            report = write_listops(args.out, sizes, args.seed, recipe, args.force)
        else:
            report = {"out": args.out}
        if args.prefixes is not None:
            report["prefixes"] = write_prefixes(args.out, args.prefixes, args.force)
        return report

    return run_writer(p.prog, write)


if __name__ == "__main__":
    sys.exit(main())
