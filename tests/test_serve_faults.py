"""`atencion serve` against hostile input and a bad start (issue #52): numbers too long to read
or not numbers at all, values echoed back whole, an empty API key, and a host or port it cannot
listen on. Each is a 4xx with one short message, or one line and exit 2 before anything is
served, never a 500 or a traceback."""

from __future__ import annotations

import json
import re
import socket

import pytest
import torch
from fastapi.testclient import TestClient

from atencion import ModelConfig, Transformer
from atencion.cli import main
from atencion.data.tokenizer import MASK, Tokenizer
from atencion.errors import AtencionError
from atencion.serve import run
from atencion.serve.app import LoadedModel, ServeSettings, create_app
from atencion.train.checkpoint import save_checkpoint
from test_faults import fault

LINES = ["the cat sat on the mat", "the dog ate the bone", "a bird sang in the tree"] * 3
SMALL = dict(n_layers=1, d_model=32, d_ff=64, n_heads=2, max_positions=64)
SHOWN = 40  # the longest run of an echoed value an error may hold (app.SHOWN)


def tiny(preset: str, tokenizer: Tokenizer, **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig.preset(preset, vocab_size=tokenizer.vocab_size, **{**SMALL, **overrides})
    return Transformer(cfg).eval()


def tiny_vit() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=0, arch="encoder", n_layers=1, d_model=16, d_ff=32, n_heads=2,
                                   num_labels=3, dropout=0.0, positional="learned", max_positions=7,
                                   inputs={"kind": "patches", "patch": 2, "size": [4, 6], "channels": 1})).eval()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train_text(LINES, "char", symbols=(MASK,))


@pytest.fixture(scope="module")
def client(tokenizer):
    """A server with a model of every kind: a translator, a GPT, a BERT, a classifier and a ViT."""
    models = [LoadedModel("translator", "", tiny("tiny", tokenizer), tokenizer),
              LoadedModel("gpt", "", tiny("gpt-tiny", tokenizer), tokenizer),
              LoadedModel("bert", "", tiny("bert-tiny", tokenizer), tokenizer),
              LoadedModel("classifier", "", tiny("bert-tiny", tokenizer, num_labels=2, labels=["neg", "pos"]),
                          tokenizer),
              LoadedModel("vit", "", tiny_vit(), None)]
    with TestClient(create_app(models, ServeSettings()), raise_server_exceptions=False) as c:
        yield c


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """A GPT's model directory, for the command line."""
    path = tmp_path_factory.mktemp("serve-faults") / "gpt"
    save_checkpoint(path, tiny("gpt-tiny", tokenizer), tokenizer)
    return str(path)


GOOD = ("translate", {"model": "translator", "sentences": ["the cat"], "beam": 1, "max_len_b": 3})


def post(client, endpoint: str, body: str):
    return client.post(f"/{endpoint}", content=body.encode(), headers={"content-type": "application/json"})


def refused(r, status: int = 422) -> str:
    """The error of a refused request: ``status``, one short line, no traceback."""
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert "\n" not in error and "Traceback" not in error and len(error) < 300, error[:300]
    return error


def keeps_serving(client) -> None:
    endpoint, body = GOOD
    assert client.post(f"/{endpoint}", json=body).status_code == 200


# 5. numbers: too long to read, or not numbers ------------------------------------------------------

LONG = "9" * 5000   # over Python's 4,300-digit int conversion limit: json.loads raised ValueError, a 500
LIMIT = "9" * 4300  # just at the limit
OVER = "1" + "0" * 100  # 101 digits

TOO_LONG = [  # (endpoint, body, the field named)
    ("translate", '{"model": "translator", "sentences": ["the"], "beam": %s}' % LONG, "beam"),
    ("translate", '{"model": "translator", "sentences": ["the"], "max_len_b": -%s}' % LONG, "max_len_b"),
    ("generate", '{"model": "gpt", "seed": %s}' % LONG, "seed"),
    ("generate", '{"model": "gpt", "max_new_tokens": %s}' % LIMIT, "max_new_tokens"),
    ("generate", '{"model": "gpt", "num_samples": %s}' % OVER, "num_samples"),
    ("fill-mask", '{"model": "bert", "text": "the <mask>", "top_k": %s}' % LONG, "top_k"),
    ("classify", '{"model": "classifier", "texts": ["the", %s]}' % LONG, "texts.1"),
    ("attention", '{"model": "gpt", "text": "the", "max_new_tokens": %s}' % LONG, "max_new_tokens"),
    ("generate", '{"model": "gpt", "temperature": %s.5}' % LONG, "temperature"),
    ("translate", '{"model": "translator", "sentences": ["the"], "extra": [[%s]]}' % LONG, "extra.0.0"),
    ("classify", '{"model": %s, "texts": ["the"]}' % LONG, "model"),
    ("transcribe", LONG, "body"),
]


@pytest.mark.parametrize("endpoint, body, field", TOO_LONG, ids=[f"{e} {f}" for e, _, f in TOO_LONG])
def test_a_number_too_long_to_read_is_a_422_naming_its_field_on_every_endpoint(client, endpoint, body, field):
    error = refused(post(client, endpoint, body))
    assert re.fullmatch(rf"{re.escape(field)}: a number of \d+ digits, more than the 100 the server reads", error)
    keeps_serving(client)


NOT_NUMBERS = [  # (endpoint, body, the error): JSON has no NaN or Infinity; 1e999 is a float's inf
    ("generate", '{"model": "gpt", "temperature": NaN}', "temperature: NaN is not a number"),
    ("generate", '{"model": "gpt", "top_p": Infinity}', "top_p: Infinity is not a number"),
    ("translate", '{"model": "translator", "sentences": ["the"], "alpha": -Infinity}',
     "alpha: -Infinity is not a number"),
    ("translate", '{"model": "translator", "sentences": ["the"], "max_len_a": 1e999}',
     "max_len_a: 1e999 is out of range (not a finite number)"),
    ("translate", '{"model": "translator", "sentences": ["the"], "beam": -1E+400}',
     "beam: -1E+400 is out of range (not a finite number)"),
    ("fill-mask", '{"model": "bert", "text": "the <mask>", "top_k": Infinity}', "top_k: Infinity is not a number"),
    ("classify", '{"model": "classifier", "texts": ["the", NaN]}', "texts.1: NaN is not a number"),
    ("attention", '{"model": "gpt", "text": "the", "induction": 1e999}',
     "induction: 1e999 is out of range (not a finite number)"),
    ("generate", '{"model": "gpt", "unknown": {"deeper": [1, -Infinity]}}', "unknown.deeper.1: -Infinity is not "
                                                                             "a number"),
    ("generate", "Infinity", "body: Infinity is not a number"),
]


@pytest.mark.parametrize("endpoint, body, message", NOT_NUMBERS, ids=[f"{e} {m}" for e, _, m in NOT_NUMBERS])
def test_nan_infinity_and_a_float_out_of_range_are_a_422_saying_so_on_every_endpoint(client, endpoint, body,
                                                                                       message):
    assert refused(post(client, endpoint, body)) == message
    keeps_serving(client)


def test_deep_nesting_and_huge_strings_are_a_short_4xx_anywhere_in_the_body(client):
    deep_list = "[" * 100_000 + "]" * 100_000
    deep_object = '{"a": ' * 100_000 + "1" + "}" * 100_000
    for endpoint, body in (("classify", '{"model": "classifier", "texts": %s}' % deep_list),
                           ("generate", '{"model": "gpt", "unknown": %s}' % deep_object),
                           ("translate", deep_list), ("fill-mask", "[" * 100_000),
                           ("generate", json.dumps({"model": "gpt", "prompt": "a" * 900_000})),
                           ("generate", json.dumps({"model": "gpt", "seed": "9" * 900_000})),
                           ("translate", json.dumps({"model": "translator", "sentences": ["a" * 900_000]}))):
        error = refused(post(client, endpoint, body))
        assert "a" * (SHOWN + 1) not in error and "9" * (SHOWN + 1) not in error, error
    keeps_serving(client)


ECHOED = [  # (endpoint, body, status, the start of the error): each quotes a value of the request
    ("generate", '{"model": "gpt", "max_new_tokens": %s}' % ("9" * 100), 422, "max_new_tokens: "),
    ("generate", '{"model": "gpt", "num_samples": %s}' % ("9" * 100), 422, "num_samples: "),
    ("classify", json.dumps({"model": "x" * 5000, "texts": ["the"]}), 404, "model: no model named 'xxx"),
    ("fill-mask", json.dumps({"model": "bert", "text": "the <mask>", "x" * 5000: 1}), 422, "xxx"),
    ("translate", json.dumps({"model": "translator", "sentences": ["the"], "x" * 5000 + "\ud800": 1}), 422,
     "body: the field name 'xxx"),
    ("generate", json.dumps({"model": "gpt", "x" * 5000: {"\ud800": 1}}), 422, "xxx"),
]


@pytest.mark.parametrize("endpoint, body, status, start", ECHOED, ids=[f"{e} {s}" for e, _, _, s in ECHOED])
def test_an_error_quotes_a_long_value_of_the_request_cut_short(client, endpoint, body, status, start):
    error = refused(post(client, endpoint, body), status)
    assert error.startswith(start) and "…" in error, error
    assert "9" * (SHOWN + 1) not in error and "x" * (SHOWN + 1) not in error, error
    keeps_serving(client)


def test_a_form_s_model_field_name_and_filename_are_quoted_cut_short(client):
    image = {"file": ("digit.npy", b"\x93NUMPY")}
    for files, data, status in ((image, {"model": "x" * 5000}, 404),
                                ({"file": ("x" * 300 + ".png", b"")}, {"model": "vit"}, 422),
                                (image, {"model": "vit", "x" * 300: "1"}, 422)):
        error = refused(client.post("/classify", files=files, data=data), status)
        assert "…" in error and "x" * (SHOWN + 1) not in error, error
    keeps_serving(client)


# 6. an API key that is empty or blank -----------------------------------------------------------

@pytest.fixture
def not_served(monkeypatch):
    """``run.serve`` replaced: what would have been served is recorded, nothing listens."""
    served = []
    monkeypatch.setattr(run, "serve", lambda models, host, port, settings: served.append(settings))
    monkeypatch.delenv("ATENCION_API_KEY", raising=False)
    return served


@pytest.mark.parametrize("key", ["", " ", "\t \n", " s3cret", "s3cret "])
def test_an_empty_blank_or_padded_api_key_option_is_refused_at_start_in_one_line(model_dir, not_served, capsys,
                                                                                 key):
    line = fault(["serve", "--model", model_dir, "--api-key", key], capsys)
    assert line.startswith("atencion serve: error: --api-key: ") and "key" in line[30:], line
    assert not_served == []


@pytest.mark.parametrize("key", ["", "   ", "\t", "s3cret\n"])
def test_an_empty_blank_or_padded_atencion_api_key_is_refused_at_start_in_one_line(model_dir, not_served,
                                                                                  monkeypatch, capsys, key):
    monkeypatch.setenv("ATENCION_API_KEY", key)
    line = fault(["serve", "--model", model_dir], capsys)
    assert line.startswith("atencion serve: error: ATENCION_API_KEY: "), line
    assert not_served == []


def test_a_good_api_key_from_the_option_or_the_environment_is_served(model_dir, not_served, monkeypatch):
    assert main(["serve", "--model", model_dir, "--api-key", "s3cret"]) == 0
    monkeypatch.setenv("ATENCION_API_KEY", "from-env")
    assert main(["serve", "--model", model_dir]) == 0
    assert main(["serve", "--model", model_dir, "--api-key", "given"]) == 0
    assert [settings.api_key for settings in not_served] == ["s3cret", "from-env", "given"]


@pytest.mark.parametrize("key", ["", "  ", " padded"])
def test_the_library_refuses_an_empty_or_blank_api_key_naming_the_field(tokenizer, key):
    with pytest.raises(AtencionError, match=r"^api_key: "):
        ServeSettings(api_key=key)
    settings = ServeSettings()
    settings.api_key = key  # set after the checks of ServeSettings
    with pytest.raises(AtencionError, match=r"^api_key: "):
        create_app([LoadedModel("gpt", "", tiny("gpt-tiny", tokenizer), tokenizer)], settings)


# 8. a host or port the server cannot listen on --------------------------------------------------

@pytest.fixture
def held_port():
    """A loopback port something else listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_serve_on_a_port_in_use_is_one_line_naming_the_port_and_exit_2_before_announcing(model_dir, held_port,
                                                                                        capsys):
    line = fault(["serve", "--model", model_dir, "--port", str(held_port)], capsys)
    assert line.startswith(f"atencion serve: error: --port {held_port}: ") and "in use" in line, line
    line = fault(["serve", "--model", model_dir, "--host", "localhost", "--port", str(held_port)], capsys)
    assert f"--port {held_port}: " in line and "in use" in line, line


@pytest.mark.parametrize("host", ["999.1.1.1", "nosuchhost.invalid", "192.0.2.1", "1.2.3"])
def test_serve_on_a_host_it_cannot_listen_on_is_one_line_naming_the_host_and_exit_2(model_dir, capsys, host):
    line = fault(["serve", "--model", model_dir, "--host", host, "--port", "0"], capsys)
    assert line.startswith(f"atencion serve: error: --host {host}: "), line


@pytest.mark.parametrize("port", ["70000", "-1", "65536", "http"])
def test_serve_refuses_a_port_out_of_range_naming_it(model_dir, capsys, port):
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--model", model_dir, "--port", port])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and "--port" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("port", [70000, -1])
def test_the_library_refuses_a_port_out_of_range_before_loading_anything(tmp_path, port):
    with pytest.raises(AtencionError, match=rf"^--port {port}: "):
        run.serve_dirs([str(tmp_path / "nothing")], port=port)
