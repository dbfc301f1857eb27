"""A Hugging Face directory's config.json and tokenizer files are read as a careless user or an
attacker may write them: every key atencion reads has a rule (interop/hf_config.py), and any JSON
value in any of those keys gives a model or one line naming the file and key, never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from atencion.errors import AtencionError  # noqa: E402
from atencion.interop import hf_config, hf_dir  # noqa: E402
from atencion.interop.vit import config_from_vit  # noqa: E402

SMALL = dict(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
             max_position_embeddings=16)
LLAMA = dict(SMALL, num_key_value_heads=1, bos_token_id=1, eos_token_id=2)
GPT2 = dict(vocab_size=50, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
LABELS = dict(num_labels=3, pad_token_id=0)
# name → (transformers class, its config class, the config's values): one tiny model of each family atencion reads
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", LLAMA),
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(LLAMA, sliding_window=8)),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", LLAMA),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", GPT2),
    "gpt2-cls": ("GPT2ForSequenceClassification", "GPT2Config", dict(GPT2, **LABELS)),
    "bert": ("BertForMaskedLM", "BertConfig", dict(SMALL, pad_token_id=0)),
    "bert-cls": ("BertForSequenceClassification", "BertConfig", dict(SMALL, **LABELS)),
    "t5": ("T5ForConditionalGeneration", "T5Config",
           dict(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0)),
    "neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
             dict(SMALL, use_parallel_residual=False, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                                       "partial_rotary_factor": 1.0})),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(vocab_size=50, hidden_size=16, n_layer=1, n_head=2)),
    "marian": ("MarianMTModel", "MarianConfig",
               dict(vocab_size=50, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                    decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16,
                    pad_token_id=49, decoder_start_token_id=49, eos_token_id=0, forced_eos_token_id=None)),
    "vit": ("ViTForImageClassification", "ViTConfig",
            dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=8,
                 patch_size=4, num_labels=2)),
}
# attributes transformers computes from a key of the file, not read from the file itself
DERIVED = {"is_gated_act": "feed_forward_proj", "dense_act_fn": "feed_forward_proj", "num_labels": "id2label"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny model as save_pretrained writes it."""
    root = tmp_path_factory.mktemp("families")
    torch.manual_seed(0)
    out = {}
    for name, (model_class, config_class, values) in FAMILIES.items():
        config = getattr(transformers, config_class)(**values)
        getattr(transformers, model_class)(config).save_pretrained(root / name)
        out[name] = root / name
    return out


class Reads:
    """A transformers config that notes the name of every attribute read from it."""

    def __init__(self, config):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "names", set())

    def __getattr__(self, name: str):
        self.names.add(name)
        return getattr(self._config, name)


def keys_read(directory: Path) -> set[str]:
    """The config.json keys the family's importer reads, found by reading it through ``Reads``."""
    module, architecture = hf_dir._family(directory)
    config = hf_dir._hf_config(directory)
    reads = Reads(config)
    if module is None:
        config_from_vit(reads)
    else:
        module.import_config(reads, architecture)
    names = {type(config).attribute_map.get(name, name) for name in reads.names}
    return {DERIVED.get(name, name) for name in names}


def test_every_key_an_importer_reads_has_a_rule(saved):
    unchecked = {name: sorted(keys_read(d) - set(hf_config.RULES)) for name, d in saved.items()}
    assert not any(unchecked.values()), unchecked
    assert all(len(keys_read(d)) >= 8 for d in saved.values())  # the recording sees the reads


def edited(source: Path, target: Path, **changes) -> Path:
    """A copy of the directory ``source`` at ``target`` whose config.json has ``changes``."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


def one_line_naming(err: AtencionError, *words: str) -> str:
    message = str(err)
    assert "\n" not in message and len(message) < 400, message
    assert all(word in message for word in words), message
    return message


# the classes of bad value, each with several members: a wrong type, a value out of range, keys that disagree
BAD = [
    ("llama", {"num_attention_heads": 3}, "num_attention_heads"),
    ("llama", {"hidden_size": "64"}, "hidden_size"),
    ("llama", {"hidden_size": 16.0}, "hidden_size"),
    ("llama", {"num_hidden_layers": True}, "num_hidden_layers"),
    ("llama", {"num_hidden_layers": 10**9}, "num_hidden_layers"),
    ("gpt2", {"n_layer": 10**6}, "n_layer"),
    ("llama", {"model_type": ["llama"]}, "model_type"),
    ("llama", {"architectures": "LlamaForCausalLM"}, "architectures"),
    ("llama", {"num_key_value_heads": 3, "num_attention_heads": 4, "hidden_size": 16}, "num_key_value_heads"),
    ("llama", {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    ("llama", {"rope_theta": float("nan")}, "rope_theta"),
    ("llama", {"rope_scaling": "linear"}, "rope_scaling"),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "factor"),
    ("llama", {"eos_token_id": [2, "</s>"]}, "eos_token_id"),
    ("llama", {"pad_token_id": 9999}, "pad_token_id"),
    ("t5", {"decoder_start_token_id": 50}, "decoder_start_token_id"),
    ("mistral", {"sliding_window": 0}, "sliding_window"),
    ("gpt2", {"n_head": 5}, "n_head"),
    ("gpt2", {"layer_norm_epsilon": "1e-5"}, "layer_norm_epsilon"),
    ("gpt2", {"resid_pdrop": 1.5}, "resid_pdrop"),
    ("gpt2-cls", {"id2label": ["neg", "pos"]}, "id2label"),
    ("bert", {"pad_token_id": 50}, "pad_token_id"),
    ("bert", {"type_vocab_size": 0}, "type_vocab_size"),
    ("t5", {"d_kv": None}, "d_kv"),
    ("t5", {"feed_forward_proj": 3}, "feed_forward_proj"),
    ("bloom", {"apply_residual_connection_post_layernorm": "false"}, "apply_residual_connection_post_layernorm"),
    ("marian", {"decoder_start_token_id": -1}, "decoder_start_token_id"),
    ("vit", {"image_size": [8]}, "image_size"),
    ("neox", {"rotary_pct": 0}, "rotary_pct"),
]


@pytest.mark.parametrize("family, changes, key", BAD, ids=[f"{f}-{k}" for f, _, k in BAD])
def test_a_bad_value_is_refused_in_one_line_naming_the_file_and_key(saved, tmp_path, family, changes, key):
    directory = edited(saved[family], tmp_path / family, **changes)
    with pytest.raises(AtencionError) as caught:
        hf_dir.read_model(directory)
    one_line_naming(caught.value, str(directory / "config.json"), key)


SIZES = [("llama", {"vocab_size": 10**12}), ("llama", {"intermediate_size": 10**11}),
         ("llama", {"hidden_size": 2**24, "num_attention_heads": 2**21, "head_dim": 8}),
         ("gpt2", {"n_embd": 2**20, "n_head": 2**17}), ("bert", {"vocab_size": 10**10}),
         ("t5", {"d_ff": 10**11}), ("marian", {"encoder_ffn_dim": 10**11, "decoder_ffn_dim": 10**11}),
         ("neox", {"vocab_size": 10**12})]


@pytest.mark.parametrize("family, changes", SIZES, ids=[f"{f}-{'-'.join(c)}" for f, c in SIZES])
def test_a_config_far_larger_than_its_weights_is_refused_before_anything_is_built(saved, tmp_path, family, changes):
    directory = edited(saved[family], tmp_path / family, **changes)
    with pytest.raises(AtencionError) as caught:
        hf_dir.read_model(directory)
    one_line_naming(caught.value, str(directory / "config.json"), "parameters", "different models")


def test_a_config_that_is_not_an_object_is_refused(saved, tmp_path):
    directory = edited(saved["gpt2"], tmp_path / "gpt2")
    for text in ("[1]", '"gpt2"', "null", "3"):
        (directory / "config.json").write_text(text)
        with pytest.raises(AtencionError) as caught:
            hf_dir.read_config(directory)
        one_line_naming(caught.value, str(directory / "config.json"))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 70) | st.integers(-10**6, 10**6) | st.floats()
    | st.sampled_from(["", "64", "silu", "gelu", "linear", "llama", "gpt2", "true"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["rope_type", "type", "factor", "rope_theta", "0", "1", "content", "x"]), inner, max_size=3),
    max_leaves=6)


@pytest.fixture(scope="module")
def reads(saved) -> dict[str, list[str]]:
    return {name: sorted(keys_read(d) | {"model_type", "architectures"}) for name, d in saved.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_any_json_value_in_any_key_atencion_reads_gives_a_model_or_one_line(saved, reads, tmp_path, family):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(key=st.sampled_from(reads[family]), value=JSON)
    def property(key, value):
        either_a_model_or_one_line(edited(saved[family], tmp_path / "case", **{key: value}))

    property()


def either_a_model_or_one_line(directory: Path) -> None:
    try:
        model = hf_dir.read_model(directory)
    except AtencionError as err:
        one_line_naming(err, str(directory))
    else:
        assert isinstance(model, torch.nn.Module)


# the tokenizer's files: tokenizer_config.json, special_tokens_map.json, generation_config.json, the chat template


@pytest.fixture(scope="module")
def llama_with_tokenizer(tmp_path_factory) -> Path:
    from test_hf_dirs import save_llama_dir

    return save_llama_dir("llama", tmp_path_factory.mktemp("tokenizer") / "llama")


def with_file(source: Path, target: Path, name: str, content) -> Path:
    """A copy of ``source`` at ``target`` whose file ``name`` holds ``content`` (bytes, or a value
    written as JSON; a dict is merged into the file's own object)."""
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    if isinstance(content, dict) and (target / name).is_file():
        content = {**json.loads((target / name).read_text()), **content}
    data = content if isinstance(content, bytes) else json.dumps(content).encode()
    (target / name).write_bytes(data)
    return target


def generate_chat(directory: Path) -> tuple[int, str]:
    from test_hf_dirs import run

    code, _, err = run("generate", "--model", str(directory), "--prompt", "the cat", "--chat", "--temperature", "0",
                       "--max-new-tokens", "2")
    return code, err


TOKENIZER_FILES = [
    ("tokenizer_config.json", [1], "tokenizer_config.json"),
    ("tokenizer_config.json", "llama", "tokenizer_config.json"),
    ("tokenizer_config.json", {"eos_token": 5}, "eos_token"),
    ("tokenizer_config.json", {"bos_token": {"content": 3}}, "bos_token"),
    ("tokenizer_config.json", {"chat_template": 3}, "chat_template"),
    ("tokenizer_config.json", {"chat_template": {"default": "{{ messages }}"}}, "chat_template"),
    ("tokenizer_config.json", {"clean_up_tokenization_spaces": "no"}, "clean_up_tokenization_spaces"),
    ("special_tokens_map.json", [], "special_tokens_map.json"),
    ("special_tokens_map.json", {"unk_token": ["<unk>"]}, "unk_token"),
    ("generation_config.json", {"pad_token_id": 99999}, "pad_token_id"),
    ("generation_config.json", {"eos_token_id": [2, "</s>"]}, "eos_token_id"),
    ("generation_config.json", {"pad_token_id": -1}, "pad_token_id"),
    ("chat_template.jinja", b"\xff\xfe{{ messages }}", "chat_template.jinja"),
]


@pytest.mark.parametrize("name, content, key", TOKENIZER_FILES, ids=[f"{n}-{k}" for n, _, k in TOKENIZER_FILES])
def test_a_tokenizer_file_of_the_wrong_shape_is_one_line_naming_the_file_and_key(llama_with_tokenizer, tmp_path,
                                                                                 name, content, key):
    directory = with_file(llama_with_tokenizer, tmp_path / "llama", name, content)
    code, err = generate_chat(directory)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert str(directory / name) in err and key in err, err


TEMPLATES = {
    "its own refusal": "{{ raise_exception('system messages are not supported') }}",
    "an unknown filter": "{{ messages | shout }}",
    "a syntax error": "{% for m in messages %}{{ m.content }}",
    "a type error": "{{ messages + 1 }}",
    "a call of nothing": "{{ messages[0].content.shout() }}",
    "an index past the end": "{{ messages[5]['content'] | upper }}",
}


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("template", list(TEMPLATES))
def test_a_chat_template_that_does_not_render_is_one_line_naming_its_file(llama_with_tokenizer, tmp_path, where,
                                                                          template):
    text = TEMPLATES[template]
    content = text.encode() if where == "chat_template.jinja" else {"chat_template": text}
    directory = with_file(llama_with_tokenizer, tmp_path / "llama", where, content)
    code, err = generate_chat(directory)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert f"{directory / where}" in err and "chat template" in err, err


TOKENIZER_KEYS = {
    "tokenizer_config.json": ["bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "cls_token",
                              "sep_token", "chat_template", "clean_up_tokenization_spaces"],
    "special_tokens_map.json": ["bos_token", "eos_token", "pad_token"],
    "generation_config.json": ["bos_token_id", "eos_token_id", "pad_token_id"],
}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(file=st.sampled_from(sorted(TOKENIZER_KEYS)), data=st.data())
def test_any_json_value_in_any_tokenizer_key_atencion_reads_gives_a_tokenizer_or_one_line(llama_with_tokenizer,
                                                                                          tmp_path, file, data):
    from atencion.data.hf_tokenizer import read_foreign

    key = data.draw(st.sampled_from(TOKENIZER_KEYS[file]))
    whole = data.draw(st.booleans())  # the file's value itself, or one of its keys
    value = data.draw(JSON | st.sampled_from(["{{ messages }}", "{% if %}", "</s>", "<s>"]))
    directory = with_file(llama_with_tokenizer, tmp_path / "llama", file, value if whole else {key: value})
    try:
        vocab, _ = read_foreign(directory)
        if vocab.chat_template is not None:
            vocab.render_chat([{"role": "user", "content": "hola"}])
    except AtencionError as err:
        one_line_naming(err, str(directory / file))


def test_a_class_transformers_loads_with_weights_of_other_sizes_is_one_line_on_stderr(saved, tmp_path):
    import subprocess
    import sys

    directory = edited(saved["vit"], tmp_path / "vit", hidden_size=32, intermediate_size=64)
    (tmp_path / "none.txt").write_text("")
    done = subprocess.run([sys.executable, "-m", "atencion", "classify", "--model", str(directory), "--input",
                           str(tmp_path / "none.txt")], capture_output=True, text=True)  # transformers' own stderr too
    err = done.stderr
    assert done.returncode == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err  # no report
    assert str(directory) in err and "other sizes than its config.json" in err, err
