"""Property tests of the readers: whatever bytes or text a user hands them, they give a result or an
AtencionError with a message (one line for the command line), never another exception."""

import dataclasses
import gzip
import json
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from atencion.config import MODEL_KEYS, ModelConfig
from atencion.data.corpus import CorpusError, read_lines, read_parallel
from atencion.errors import AtencionError
from atencion.fileio import read_json
from atencion.train.config import SECTIONS, TrainConfig, load_config
from atencion.viz.attention import format_pharaoh, parse_pharaoh

# No "explain" phase: it traces every line run, which takes minutes on a deeply nested file.
PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
FAST = settings(max_examples=150, deadline=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=60, deadline=None, phases=PHASES, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ------------------------------------------------------------------------------------

# Characters a reader has to be careful with: line and field separators, Unicode whitespace that
# str.strip() removes and bytes.strip() keeps, digits that are not ASCII, a BOM.
TRICKY = "\t\n\r \x0b\x0c\x1c\x85\xa0\u2028\u3000\ufeff-?:=.[]{}#'\"0123456789²١aé"
chars = st.characters(exclude_categories=("Cs",))  # text that can be written as UTF-8
text = st.text(st.one_of(st.sampled_from(TRICKY), chars), max_size=80)
file_bytes = st.one_of(
    st.binary(max_size=200),
    text.map(lambda s: s.encode("utf-8")),
    st.lists(text, max_size=6).map(lambda lines: "\n".join(lines).encode("utf-8")),
)


def _corrupt(data: bytes, position: int, mask: int) -> bytes:
    out = bytearray(data)
    out[position % len(out)] ^= mask
    return bytes(out)


compressed = st.one_of(
    file_bytes.map(gzip.compress),                                                       # valid gzip
    st.tuples(file_bytes.map(gzip.compress), st.integers(0, 400), st.integers(1, 255))  # one bad byte
    .map(lambda t: _corrupt(*t)),
    st.tuples(file_bytes.map(gzip.compress), st.integers(1, 400))                         # truncated
    .map(lambda t: t[0][: t[1] % len(t[0])]),
    st.binary(max_size=60).map(lambda tail: b"\x1f\x8b\x08\x00" + tail),                # a gzip header, then noise
    file_bytes,                                                                          # not gzip at all
)

# A sentence that survives the reader unchanged: not empty, no tab or line break, nothing strip() removes.
sentence = st.text(st.one_of(chars.filter(lambda c: c not in "\t\n\r"), st.sampled_from("aé\x85\u2028 ")),
                   min_size=1, max_size=20).filter(lambda s: s.strip() == s != "")


@contextmanager
def files(**contents: bytes):
    """Write each ``name=bytes`` to a fresh directory, "_" in a name becoming "." (a_en_gz is
    a.en.gz); yields a dict of their paths."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for key, data in contents.items():
            path = Path(tmp) / key.replace("_", ".")
            path.write_bytes(data)
            paths[key] = path
        yield paths


def result_or_error(call, *names, one_line=True, error=AtencionError):
    """``call()``'s result, or None after an ``error`` whose message is not empty, is one line (if
    ``one_line``) and names one of ``names`` (if any). Any other exception fails the test."""
    try:
        return call()
    except error as err:
        message = str(err)
        assert message.strip() and not (one_line and "\n" in message), repr(message)
        if names:
            assert any(str(name) in message for name in names), (message, names)
        return None


# -- corpus: read_lines ------------------------------------------------------------------------------

@FAST
@given(data=file_bytes, allow_empty=st.booleans())
def test_arbitrary_bytes_as_a_text_file_give_its_lines_or_a_corpus_error_naming_it(data, allow_empty):
    with files(a_txt=data) as p:
        lines = result_or_error(lambda: read_lines(p["a_txt"], allow_empty), p["a_txt"], error=CorpusError)
    try:
        text_ = data.decode("utf-8")
    except UnicodeDecodeError:
        assert lines is None, "invalid UTF-8 was read"
        return
    if not data.strip() and not allow_empty:
        assert lines is None, "an empty file was read"
        return
    assert lines is not None, "a valid UTF-8 file was refused"
    assert lines == ([line.rstrip("\r") for line in text_.removesuffix("\n").split("\n")] if text_ else [])


@FAST
@given(data=compressed, allow_empty=st.booleans())
def test_arbitrary_bytes_as_a_gz_file_give_lines_or_a_corpus_error_naming_it(data, allow_empty):
    with files(a_txt_gz=data) as p:
        lines = result_or_error(lambda: read_lines(p["a_txt_gz"], allow_empty), p["a_txt_gz"], error=CorpusError)
    assert lines is None or all(isinstance(line, str) and "\n" not in line for line in lines)


@FAST
@given(payload=file_bytes)
def test_valid_gzip_reads_like_the_same_bytes_uncompressed(payload):
    with files(a_gz=gzip.compress(payload), a_txt=payload) as p:
        assert (result_or_error(lambda: read_lines(p["a_gz"], True), p["a_gz"], error=CorpusError)
                == result_or_error(lambda: read_lines(p["a_txt"], True), p["a_txt"], error=CorpusError))


# -- corpus: read_parallel ---------------------------------------------------------------------------

def _check_pairs(out):
    if out is None:
        return
    pairs, report = out
    assert pairs and report.pairs == len(pairs)
    for s, t in pairs:
        assert s and t and s == s.strip() and t == t.strip(), (s, t)


@FAST
@given(src=file_bytes, tgt=file_bytes.map(lambda b: ("a_tgt", b)) | compressed.map(lambda b: ("a_tgt_gz", b)),
       empty_lines=st.sampled_from(["skip", "error"]))
def test_arbitrary_bytes_as_two_aligned_files_give_clean_pairs_or_a_corpus_error(src, tgt, empty_lines):
    with files(a_src=src, **dict([tgt])) as p:
        _check_pairs(result_or_error(lambda: read_parallel(p["a_src"], p[tgt[0]], empty_lines),
                                     p["a_src"], p[tgt[0]], error=CorpusError))


@FAST
@given(data=file_bytes, empty_lines=st.sampled_from(["skip", "error"]))
def test_arbitrary_bytes_as_a_tsv_file_give_clean_pairs_or_a_corpus_error(data, empty_lines):
    with files(a_tsv=data) as p:
        out = result_or_error(lambda: read_parallel(p["a_tsv"], None, empty_lines), p["a_tsv"], error=CorpusError)
    _check_pairs(out)


@FAST
@given(lines=st.lists(st.text(st.sampled_from("\tab \r\x85"), max_size=8), min_size=1, max_size=8),
       empty_lines=st.sampled_from(["skip", "error"]))
def test_a_tsv_file_is_read_only_when_every_line_has_exactly_one_tab(lines, empty_lines):
    with files(a_tsv="\n".join(lines).encode()) as p:
        out = result_or_error(lambda: read_parallel(p["a_tsv"], None, empty_lines), p["a_tsv"], error=CorpusError)
    _check_pairs(out)
    if out is not None:  # a last empty line is the file's final newline
        assert all(line.count("\t") == 1 for line in (lines[:-1] if lines[-1] == "" else lines))


@FAST
@given(empty_lines=text)
def test_an_unknown_empty_lines_policy_is_an_atencion_error(empty_lines):
    with files(a_tsv=b"a\tb\n") as p:
        out = result_or_error(lambda: read_parallel(p["a_tsv"], None, empty_lines), "empty_lines")
    assert (out is not None) == (empty_lines in ("skip", "error"))


@FEW
@given(pairs=st.lists(st.tuples(sentence, sentence), min_size=1, max_size=12), gz=st.booleans(),
       crlf=st.booleans(), final_newline=st.booleans())
def test_well_formed_pairs_come_back_exactly_and_in_order(pairs, gz, crlf, final_newline):
    end = "\r\n" if crlf else "\n"

    def encode(lines):
        data = (end.join(lines) + (end if final_newline else "")).encode("utf-8")
        return gzip.compress(data) if gz else data

    gz_ = "_gz" if gz else ""
    with files(**{"a_src" + gz_: encode([s for s, _ in pairs]), "a_tgt" + gz_: encode([t for _, t in pairs]),
                  "a_tsv" + gz_: encode([f"{s}\t{t}" for s, t in pairs])}) as p:
        src, tgt, tsv = (p[name + gz_] for name in ("a_src", "a_tgt", "a_tsv"))
        for out in (read_parallel(src, tgt), read_parallel(tsv), read_parallel(tsv, empty_lines="error")):
            assert out[0] == pairs
            assert out[1].pairs == len(pairs) and out[1].empty_skipped == 0


@FEW
@given(rows=st.lists(st.tuples(st.one_of(sentence, st.sampled_from(["", " ", "\x85"])),
                               st.one_of(sentence, st.sampled_from(["", "\u3000"]))), min_size=1, max_size=12))
def test_pairs_with_an_empty_side_are_skipped_and_counted_the_others_kept_in_order(rows):
    kept = [(s, t) for s, t in rows if s.strip() and t.strip()]
    with files(a_tsv="\n".join(f"{s}\t{t}" for s, t in rows).encode("utf-8")) as p:
        out = result_or_error(lambda: read_parallel(p["a_tsv"]), p["a_tsv"], error=CorpusError)
        if kept:
            assert out[0] == kept and out[1].empty_skipped == len(rows) - len(kept)
        else:
            assert out is None
        if len(kept) < len(rows):
            strict = result_or_error(lambda: read_parallel(p["a_tsv"], empty_lines="error"), p["a_tsv"],
                                     error=CorpusError)
            assert strict is None


# -- Pharaoh alignments (atencion aer --align) ----------------------------------------------------------

LINK = re.compile(r"[0-9]+[-?][0-9]+")
pharaoh_text = st.one_of(
    text,
    st.lists(st.text(st.sampled_from("0123456789-?²١x"), min_size=1, max_size=6), max_size=6).map(" ".join),
)


@FAST
@given(line=pharaoh_text)
def test_an_arbitrary_alignment_line_gives_links_or_an_atencion_error(line):
    out = result_or_error(lambda: parse_pharaoh(line, "line 7"), "line 7")
    assert (out is not None) == all(LINK.fullmatch(item) for item in line.split()), line
    if out is not None:
        sure, possible = out
        assert sure <= possible
        assert all(isinstance(i, int) and isinstance(j, int) and i >= 0 and j >= 0 for i, j in possible)
        assert len(possible) <= len(line.split())


links = st.sets(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6)), max_size=20)


@FAST
@given(sure=links, possible=links)
def test_formatted_alignments_parse_back_to_the_same_links(sure, possible):
    assert parse_pharaoh(format_pharaoh(sure)) == (sure, sure)
    line = format_pharaoh(sure) + " " + " ".join(f"{i}?{j}" for i, j in possible)
    assert parse_pharaoh(line) == (sure, possible | sure)


# -- training config (YAML) ------------------------------------------------------------------------------

scalar_text = st.one_of(
    text,
    st.integers().map(str),
    st.floats().map(str),
    st.sampled_from(["~", "null", "yes", "no", "on", ".inf", "-.nan", "0x1F", "0o17", "1_000", "1e400", "[",
                     "{a: 1", "]", "'", '"', "*alias", "&a x", "!!binary x", "!!python/name:os.system", "- a",
                     "? a", "|", ">", "%YAML 1.1", "---", "...", "@", "`"]),
    st.tuples(st.integers(0, 9999), st.integers(0, 99), st.integers(0, 99))
    .map(lambda t: "{:04d}-{:02d}-{:02d}".format(*t)),                                      # YAML dates
    st.lists(st.integers(-5, 5) | st.floats(-2, 2) | st.just("a"), max_size=3).map(str),     # flow lists
)
yaml_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
FIELDS = {"model": sorted(MODEL_KEYS)} | {
    name: [f.name for f in dataclasses.fields(cls)] for name, cls in SECTIONS.items()}
section_name = st.sampled_from(sorted(FIELDS)) | text
config_mapping = st.one_of(
    st.fixed_dictionaries({}, optional={                     # known sections, mostly known keys
        name: yaml_value | st.dictionaries(st.sampled_from(keys) | text | st.integers(), yaml_value, max_size=4)
        for name, keys in FIELDS.items()}),
    st.dictionaries(section_name | st.integers() | st.none(), yaml_value, max_size=3),
)
yaml_file = st.one_of(
    st.binary(max_size=200),
    text.map(str.encode),
    scalar_text.map(str.encode),
    config_mapping.map(lambda m: yaml.safe_dump(m, allow_unicode=True, sort_keys=False).encode("utf-8")),
    st.sampled_from([10, 5000]).map(lambda n: b"[" * n),              # 5000: deeper than Python recurses
)


@st.composite
def override(draw):
    section = draw(section_name)
    key = draw(st.sampled_from(FIELDS.get(section) or ["x"]) | text)
    return f"{section}.{key}={draw(scalar_text)}"


overrides = st.lists(text | override(), max_size=3)


@FAST
@given(data=yaml_file)
def test_arbitrary_bytes_as_a_config_file_give_a_config_or_an_atencion_error_naming_it(data):
    with files(run_yaml=data) as p:
        cfg = result_or_error(lambda: load_config(p["run_yaml"]), p["run_yaml"], one_line=False)
    assert cfg is None or isinstance(cfg, TrainConfig)


@FAST
@given(items=overrides)
def test_arbitrary_set_overrides_give_a_config_or_an_atencion_error(items):
    cfg = result_or_error(lambda: load_config(None, items), one_line=False)
    assert cfg is None or isinstance(cfg, TrainConfig)


@FAST
@given(data=yaml_file, items=overrides)
def test_arbitrary_overrides_on_an_arbitrary_config_file_give_a_config_or_an_atencion_error(data, items):
    with files(run_yaml=data) as p:
        cfg = result_or_error(lambda: load_config(p["run_yaml"], items), one_line=False)
    assert cfg is None or isinstance(cfg, TrainConfig)


@FAST
@given(steps=st.integers(0, 10**9), beam=st.integers(1, 100), peak=st.floats(1e-3, 1.0))
def test_well_formed_overrides_set_their_key(steps, beam, peak):
    cfg = load_config(None, [f"train.max_steps={steps}", f"decode.beam={beam}", f"train.lr_peak={peak!r}"])
    assert (cfg.train.max_steps, cfg.decode.beam, cfg.train.lr_peak) == (steps, beam, peak)


# -- model config (config.json) and read_json -------------------------------------------------------------

json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
model_dict = st.dictionaries(
    st.sampled_from(MODEL_FIELDS),
    json_value | st.integers(-3, 64) | st.sampled_from([0.0, 0.5, 1.0, "relu", "gelu", "sinusoidal", "learned"]),
    max_size=len(MODEL_FIELDS),
)
json_bytes = st.one_of(
    st.binary(max_size=200),
    text.map(str.encode),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([10, 5000]).map(lambda n: b"[" * n),              # 5000: deeper than Python recurses
    st.integers(4000, 5000).map(lambda n: b"9" * n),                  # longer than int() converts
    st.sampled_from([b"NaN", b"-Infinity", b'{"a": 1, "a": 2}', b"\xef\xbb\xbf{}", b'"\\ud800"']),
)


@FAST
@given(data=json_bytes)
def test_arbitrary_bytes_as_a_json_file_give_its_value_or_an_atencion_error_naming_it(data):
    with files(info_json=data) as p:
        result_or_error(lambda: read_json(p["info_json"], "description"), p["info_json"])
    try:
        expected = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return
    with files(info_json=data) as p:
        assert json.dumps(read_json(p["info_json"], "description")) == json.dumps(expected)


@FAST
@given(data=json_bytes | model_dict.map(lambda d: json.dumps(d).encode()))
def test_arbitrary_bytes_as_a_model_config_give_a_config_or_an_atencion_error_naming_it(data):
    with files(config_json=data) as p:
        cfg = result_or_error(lambda: ModelConfig.load(p["config_json"]), p["config_json"])
    assert cfg is None or isinstance(cfg, ModelConfig)


@FAST
@given(values=model_dict | json_value)
def test_arbitrary_json_as_a_model_config_gives_a_valid_config_that_round_trips_or_an_atencion_error(values):
    with files(config_json=json.dumps(values).encode()) as p:
        cfg = result_or_error(lambda: ModelConfig.load(p["config_json"]), p["config_json"])
        if cfg is None:
            return
        assert cfg.d_model % cfg.n_heads == 0 and cfg.vocab_size > 0
        assert 0 <= cfg.pad_id < min(cfg.vocab_size, cfg.target_vocab_size)
        cfg.save(p["config_json"])
        assert ModelConfig.load(p["config_json"]) == cfg


@FEW
@given(d_model=st.integers(1, 64), n_heads=st.integers(1, 64), vocab=st.integers(1, 10))
def test_a_config_json_is_refused_exactly_when_its_sizes_do_not_fit(d_model, n_heads, vocab):
    values = {"vocab_size": vocab, "d_model": d_model, "n_heads": n_heads, "pad_id": 0, "bos_id": 0, "eos_id": 0}
    with files(config_json=json.dumps(values).encode()) as p:
        cfg = result_or_error(lambda: ModelConfig.load(p["config_json"]), p["config_json"])
    assert (cfg is not None) == (d_model % n_heads == 0 and d_model % 2 == 0)
