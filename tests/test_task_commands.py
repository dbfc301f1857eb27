"""A task brings its own command (``TaskSpec.command``) and endpoint (``TaskSpec.endpoint``):
`atencion --help` lists and runs the one, `atencion serve` serves the other, with no line of cli.py
or serve/app.py naming it; and the sampling settings travel as one ``SamplingConfig``."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from atencion.arguments import Command, bounded
from atencion.cli import build_parser, main
from atencion.decode.settings import SamplingConfig, sampling_config
from atencion.endpoint import Refused, RequestBody, TaskEndpoint
from atencion.errors import AtencionError
from atencion.tasks import TASKS, USES
from atencion.tasks.base import register_task

HEARD: list[int] = []


def add_toy_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--times", type=bounded(int, 1, highest=9), default=2, help="how many times")


def cmd_toy(args: argparse.Namespace) -> None:
    """Say toy --times times."""
    HEARD.append(args.times)
    print("toy " * args.times)


class ToyRequest(RequestBody):
    text: str
    model: str | None = None
    times: int = 2


async def serve_toy(body: ToyRequest, m, ctx) -> dict:
    if body.times > ctx.settings.max_sentences:
        raise Refused(422, f"times: more than {ctx.settings.max_sentences}")
    return {"model": m.name, "echo": body.text * body.times}


@pytest.fixture
def toy_task():
    """A task registered from this file alone (the language model's spec under another name, use
    and command), removed afterwards."""
    spec = dataclasses.replace(TASKS["lm"], name="toy", use="toy-use",
                               command=Command("toy-command", "a toy task's command", add_toy_arguments, cmd_toy),
                               endpoint=TaskEndpoint(ToyRequest, serve_toy, defaults=("times",),
                                                     info=lambda m: {"toy": m.name}))
    register_task(spec)
    HEARD.clear()
    yield spec
    del TASKS["toy"], USES["toy-use"]


def test_a_task_registered_alone_brings_its_command_to_the_command_line(toy_task, capsys):
    names = list(build_parser()._subparsers._group_actions[0].choices)
    assert "toy-command" in names
    assert names.index("train") < names.index("translate") < names.index("toy-command") < names.index("evaluate")
    assert main(["toy-command", "--times", "3"]) == 0
    assert HEARD == [3] and capsys.readouterr().out == "toy toy toy \n"


def test_a_task_commands_bad_number_is_named_by_its_option(toy_task, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["toy-command", "--times", "10"])
    assert exit_.value.code == 2
    assert "--times: expected an integer >= 1 and <= 9, got '10'" in capsys.readouterr().err
    assert HEARD == []


def test_without_the_task_its_command_is_unknown(capsys):
    assert "toy-command" not in build_parser()._subparsers._group_actions[0].choices
    with pytest.raises(SystemExit):
        main(["toy-command"])
    assert "invalid choice: 'toy-command'" in capsys.readouterr().err


def test_every_task_with_a_use_on_the_command_line_has_its_command():
    commands = {spec.command.name for spec in TASKS.values() if spec.command is not None}
    assert commands == {"translate", "transcribe", "generate", "fill-mask", "classify"}
    for spec in TASKS.values():
        if spec.command is not None:
            assert spec.command.name == spec.use  # the command is the task's use, as the server's endpoint is


def test_sampling_settings_travel_as_one_object_or_as_keywords():
    base = SamplingConfig(max_new_tokens=10, seed=3)
    assert sampling_config(base, temperature=0.5) == SamplingConfig(10, 0.5, seed=3)
    assert sampling_config(None, top_k=2) == SamplingConfig(top_k=2)
    with pytest.raises(TypeError):
        sampling_config(base, temprature=0.5)
    with pytest.raises(TypeError):
        sampling_config({"max_new_tokens": 3})


@pytest.mark.parametrize("settings, message", [
    (dict(temperature=-1.0), "--temperature must be >= 0 and finite"),
    (dict(top_p=0.0), "--top-p must be in (0, 1]"),
    (dict(top_k=-1), "--top-k must be an integer >= 0"),
    (dict(num_samples=0), "--num-samples must be a positive integer, got 0"),
    (dict(max_new_tokens=True), "--max-new-tokens must be a positive integer, got True"),
    (dict(draft_tokens=0), "--draft-tokens must be a positive integer, got 0"),
])
def test_sampling_settings_that_draw_nothing_are_refused_naming_the_option(settings, message):
    with pytest.raises(AtencionError, match=message.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        SamplingConfig(**settings).check()
    SamplingConfig().check()  # the defaults draw


def test_a_task_registered_alone_brings_its_endpoint_to_the_server(toy_task, demo_model_dir):
    from fastapi.testclient import TestClient

    from atencion.nn.model_dir import load_model_dir
    from atencion.serve.app import LoadedModel, ServeSettings, create_app
    from conftest import small_model

    model, tokenizer = load_model_dir(demo_model_dir)
    translator = LoadedModel("mt", str(demo_model_dir), model, tokenizer)
    decoder = LoadedModel("gpt", "", small_model(arch="decoder", vocab_size=tokenizer.vocab_size).eval(), tokenizer)
    assert decoder.endpoints == ["generate", "toy-use", "attention"] and "toy-use" not in translator.endpoints
    app = create_app([decoder, translator], ServeSettings(max_sentences=3))
    assert "/toy-use" in {r.path for r in app.routes}
    with TestClient(app) as client:
        r = client.post("/toy-use", json={"text": "ab", "times": 3})
        assert r.status_code == 200 and r.json() == {"model": "gpt", "echo": "ababab"}, r.text
        r = client.post("/toy-use", json={"text": "ab", "times": 4})
        assert r.status_code == 422 and r.json()["error"] == "times: more than 3", r.text
        r = client.post("/toy-use", json={"text": "ab", "times": "3"})
        assert r.status_code == 422 and r.json()["error"].startswith("times: "), r.text
        r = client.post("/toy-use", json={"text": "ab", "model": "mt"})
        assert r.status_code == 400 and r.json()["error"].startswith("/toy-use needs a decoder-only model"), r.text
        described = {m["name"]: m for m in client.get("/info").json()["models"]}
        assert described["gpt"]["toy"] == "gpt" and "/toy-use" in described["gpt"]["endpoints"]


def test_without_the_task_its_endpoint_is_not_served():
    from atencion.serve.app import model_endpoints

    assert "toy-use" not in {e.name for e in model_endpoints()}
    assert {e.name for e in model_endpoints()} == {"translate", "generate", "fill-mask", "classify", "transcribe",
                                                   "attention"}
