"""`atencion chat` (atencion/chat.py) on tiny random Hugging Face directories whose tokenizer has a
chat template: each reply is transformers' own greedy continuation of the history as its
``apply_chat_template`` writes it, turns build on the replies, /reset forgets them, Ctrl-C stops a
reply and not the chat, a history too long for learned positions loses its oldest exchanges, and
a model that cannot chat is refused in one line."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from atencion.chat import Chat  # noqa: E402
from atencion.data.tokenizer import Tokenizer  # noqa: E402
from atencion.decode import sample  # noqa: E402
from atencion.nn.model_dir import load_model_dir  # noqa: E402
from conftest import run_cli  # noqa: E402
from test_hf_dirs import CHAT, byte_level_bpe, hf_tokenizer, save_llama_dir, wordpiece  # noqa: E402
from test_lm_commands import LINES, save  # noqa: E402

SYSTEM = "be brief"
NEW = 12  # tokens per reply in these tests


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A Llama directory with a chat template (test_hf_dirs' CHAT) and the same one without it; a GPT-2
    of 64 learned positions with one; a BERT and a translator, which cannot chat."""
    root = tmp_path_factory.mktemp("chat")
    out = {"plain": save_llama_dir("llama", root / "plain"), "llama": root / "llama"}
    config = json.loads((out["plain"] / "config.json").read_text())  # a context of 512: the long chats fit
    (out["plain"] / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    shutil.copytree(out["plain"], out["llama"])
    theirs = hf_tokenizer(out["llama"])
    theirs.chat_template = CHAT
    theirs.save_pretrained(out["llama"])
    bpe = byte_level_bpe()  # with CHAT
    torch.manual_seed(0)
    out["gpt2"] = root / "gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=len(bpe), n_positions=64, n_embd=32, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0,
        initializer_range=0.3)).save_pretrained(out["gpt2"])
    bpe.save_pretrained(out["gpt2"])
    wp = transformers.BertConfig(vocab_size=len(wordpiece()), hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    out["bert"] = root / "bert"
    transformers.BertForMaskedLM(wp).save_pretrained(out["bert"])
    wordpiece().save_pretrained(out["bert"])
    out["translator"] = Path(save(root / "translator", "tiny", Tokenizer.train_text(LINES, "sentencepiece",
                                                                                     vocab_size=60)))
    return out


def their_prompt(directory: Path, messages: list[dict[str, str]]) -> list[int]:
    """The ids transformers writes ``messages`` as, with the assistant's prompt at the end."""
    ids = hf_tokenizer(directory).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def their_greedy_reply(directory: Path, ids: list[int], stop: list[int], new: int = NEW) -> tuple[str, list[int]]:
    """transformers' greedy continuation of ``ids`` up to (not with) the first of ``stop``: its text and ids."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    tokens = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new, eos_token_id=stop,
                         pad_token_id=stop[0])[0, len(ids):].tolist()
    tokens = tokens[:next((i for i, t in enumerate(tokens) if t in stop), len(tokens))]
    return hf_tokenizer(directory).decode(tokens, skip_special_tokens=True), tokens


def prompts_fed(monkeypatch) -> list[list[int]]:
    """Record the prompt of every generation the chat asks for (and let it run)."""
    seen = []
    real = sample.generate_ids

    def recording(model, prompt, *args, **kwargs):
        seen.append(prompt[0].tolist())
        return real(model, prompt, *args, **kwargs)

    monkeypatch.setattr(sample, "generate_ids", recording)
    return seen


def chat_of(directory: Path, **settings) -> Chat:
    model, tokenizer = load_model_dir(directory)
    return Chat(model, tokenizer, **{"max_new_tokens": NEW, "temperature": 0, **settings})


# replies ------------------------------------------------------------------------------------------


def test_a_greedy_reply_is_transformers_greedy_continuation_of_the_rendered_history(dirs, tmp_path):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the cat sat"}]
    ids = their_prompt(dirs["llama"], messages)
    expected, tokens = their_greedy_reply(dirs["llama"], ids, [2])
    assert len(tokens) == NEW and len(set(tokens)) > 3  # a text that varies, not one token repeated
    chat, out, err = chat_of(dirs["llama"], system=SYSTEM), io.StringIO(), io.StringIO()
    assert chat.say("the cat sat", out, err) == expected
    assert out.getvalue() == expected + "\n" and err.getvalue() == ""
    assert chat.messages() == [*messages, {"role": "assistant", "content": expected}]
    # a stop id of generation_config.json (here the greedy text's 4th new token) ends the reply before it
    stop = next(t for k, t in enumerate(tokens) if k >= 3 and t not in tokens[:k])
    stopping = tmp_path / "stopping"
    shutil.copytree(dirs["llama"], stopping)
    config = json.loads((stopping / "generation_config.json").read_text())
    (stopping / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, stop]}))
    short, short_tokens = their_greedy_reply(stopping, ids, [2, stop])
    assert short_tokens == tokens[:tokens.index(stop)] and short != expected
    assert chat_of(stopping, system=SYSTEM).say("the cat sat", io.StringIO()) == short


def test_each_turn_reads_the_whole_history_with_the_replies_as_transformers_writes_it(dirs, monkeypatch):
    seen = prompts_fed(monkeypatch)
    chat, out = chat_of(dirs["llama"]), io.StringIO()
    first = chat.say("the cat sat", out)
    second = chat.say("a dog ran", out)
    history = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": first},
               {"role": "user", "content": "a dog ran"}]
    assert seen == [their_prompt(dirs["llama"], history[:1]), their_prompt(dirs["llama"], history)]
    assert first and first in hf_tokenizer(dirs["llama"]).decode(seen[1])
    assert second == their_greedy_reply(dirs["llama"], seen[1], [2])[0]
    assert out.getvalue() == f"{first}\n{second}\n"
    # sampled: the same seed gives the same replies, and they are not the greedy ones
    replies = [chat_of(dirs["llama"], temperature=1.0, seed=3).say("the cat sat", io.StringIO()) for _ in range(2)]
    assert replies[0] == replies[1] != first


def test_reset_forgets_the_history_but_not_the_system_message_and_commands_are_answered(dirs, monkeypatch):
    seen = prompts_fed(monkeypatch)
    chat, out, err = chat_of(dirs["llama"], system=SYSTEM), io.StringIO(), io.StringIO()
    lines = ["the cat sat\n", "/reset\n", "", "   \n", "/frobnicate\n", "a dog ran\n", "/exit\n", "never read\n"]
    assert chat.run(iter(lines), out, err) == 0
    system = {"role": "system", "content": SYSTEM}
    assert seen == [their_prompt(dirs["llama"], [system, {"role": "user", "content": text}])
                    for text in ("the cat sat", "a dog ran")]
    fresh = [chat_of(dirs["llama"], system=SYSTEM).say(text, io.StringIO()) for text in ("the cat sat", "a dog ran")]
    assert out.getvalue() == f"{fresh[0]}\n{fresh[1]}\n" and chat.turns[1]["content"] == fresh[1]
    notes = err.getvalue().splitlines()
    assert len(notes) == 2 and "forgotten" in notes[0] and "system message stays" in notes[0]
    assert "unknown command /frobnicate" in notes[1] and "/reset" in notes[1] and "/exit" in notes[1]


# ending and Ctrl-C -------------------------------------------------------------------------------------


def test_piped_input_gives_the_replies_alone_and_exit_or_end_of_input_ends_with_status_0(dirs):
    chat = chat_of(dirs["llama"])
    expected = [chat.say(text, io.StringIO()) + "\n" for text in ("the cat sat", "a dog ran")]
    command = [sys.executable, "-m", "atencion", "chat", "--model", str(dirs["llama"]), "--temperature", "0",
               "--max-new-tokens", str(NEW)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONIOENCODING": "utf-8"}

    def chatting(typed: str) -> tuple[int, str, str]:
        done = subprocess.run(command, input=typed.encode(), capture_output=True, timeout=120, env=env)
        return done.returncode, done.stdout.decode(), done.stderr.decode()

    assert chatting("the cat sat\n/exit\nnever answered\n") == (0, expected[0], "")
    # the last line without its line break, then the end of input
    assert chatting("the cat sat\n\na dog ran") == (0, expected[0] + expected[1], "")


def interrupting(monkeypatch, at_step: int, interrupt) -> None:
    """The chat's first generation is interrupted by ``interrupt()`` at step ``at_step``, before the
    step's token is shown; later ones run as they are."""
    real, calls = sample.generate_ids, []

    def once(model, prompt, *args, on_step=None, **kwargs):
        calls.append(1)

        def step(k, tokens):
            if len(calls) == 1 and k == at_step:
                interrupt()
            on_step(k, tokens)

        return real(model, prompt, *args, on_step=step, **kwargs)

    monkeypatch.setattr(sample, "generate_ids", once)


def test_ctrl_c_during_a_reply_stops_it_keeps_what_was_shown_and_the_chat_goes_on(dirs, monkeypatch):
    whole = chat_of(dirs["llama"])
    full, second = whole.say("the cat sat", io.StringIO()), whole.say("a dog ran", io.StringIO())
    ids = their_prompt(dirs["llama"], [{"role": "user", "content": "the cat sat"}])
    partial = hf_tokenizer(dirs["llama"]).decode(their_greedy_reply(dirs["llama"], ids, [2])[1][:3])

    def ctrl_c():
        raise KeyboardInterrupt

    interrupting(monkeypatch, 3, ctrl_c)
    seen = prompts_fed(monkeypatch)
    chat, out, err = chat_of(dirs["llama"]), io.StringIO(), io.StringIO()
    assert chat.run(["the cat sat", "a dog ran"], out, err) == 0
    assert partial and full.startswith(partial) and partial != full
    assert chat.turns[1] == {"role": "assistant", "content": partial}
    history = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": partial},
               {"role": "user", "content": "a dog ran"}]
    assert seen[1] == their_prompt(dirs["llama"], history) and seen[1] != their_prompt(dirs["llama"], [
        *history[:1], {"role": "assistant", "content": full}, history[2]])
    assert chat.turns[3]["content"] == their_greedy_reply(dirs["llama"], seen[1], [2])[0] != second
    assert out.getvalue() == f"{partial}\n{chat.turns[3]['content']}\n" and err.getvalue() == ""


def test_ctrl_c_at_the_prompt_ends_the_chat_with_a_line_break(dirs):
    def typed():
        yield "the cat sat"
        raise KeyboardInterrupt

    chat, out = chat_of(dirs["llama"]), io.StringIO()
    assert chat.run(typed(), out, io.StringIO()) == 0
    assert out.getvalue() == chat.turns[1]["content"] + "\n\n"


def test_a_real_sigint_during_a_reply_leaves_the_command_going_on_to_status_0(dirs, monkeypatch, capsys):
    """SIGINT itself, through the command line's own handler (interrupt.py, which would raise it again
    when the command ends, as status 130) and the chat's."""
    interrupting(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGINT))
    seen = prompts_fed(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the cat sat\na dog ran\n"), encoding="utf-8"))
    code, out, err = run_cli(["chat", "--model", str(dirs["llama"]), "--temperature", "0", "--max-new-tokens",
                              str(NEW)], capsys)
    assert (code, err) == (0, "")
    # the first reply was cut after some of its greedy tokens: the second turn read that much of it
    tokens = their_greedy_reply(dirs["llama"], seen[0], [2])[1]
    shown = [hf_tokenizer(dirs["llama"]).decode(tokens[:k]) for k in range(len(tokens))]
    partial = next(text for text in shown if seen[1] == their_prompt(dirs["llama"], [
        {"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": text},
        {"role": "user", "content": "a dog ran"}]))
    assert out == f"{partial}\n{their_greedy_reply(dirs['llama'], seen[1], [2])[0]}\n"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back as it was


# refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, words", [
    ("plain", ["no chat template", "atencion generate"]),
    ("bert", ["decoder-only", "fill-mask"]),
    ("translator", ["decoder-only", "translate"]),
])
def test_a_model_that_cannot_chat_is_refused_in_one_line_naming_its_directory(dirs, capsys, name, words):
    code, out, err = run_cli(["chat", "--model", str(dirs[name])], capsys)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1 and "Traceback" not in err
    assert str(dirs[name]) in err and all(word in err for word in words), err


@pytest.mark.parametrize("options, words", [
    (["--top-p", "0"], ["--top-p", "expected a number > 0.0"]),
    (["--max-new-tokens", "0"], ["--max-new-tokens", "expected an integer >= 1"]),
    (["--temperature", "-1"], ["--temperature"]),
    (["--max-new-tokens", "60"], ["--max-new-tokens 60", "max_positions=64", "give at most"]),
])
def test_bad_settings_are_one_line_naming_the_option(dirs, capsys, options, words):
    code, out, err = run_cli(["chat", "--model", str(dirs["gpt2"]), *options], capsys)
    assert (code, out) == (2, "") and len(err.splitlines()) == 1 and "Traceback" not in err
    assert all(word in err for word in words), err


# a history longer than the learned positions --------------------------------------------------------------


def test_the_oldest_exchanges_are_left_out_when_the_history_passes_the_learned_positions(dirs, monkeypatch):
    seen = prompts_fed(monkeypatch)
    chat, out, err = chat_of(dirs["gpt2"], system="hi", max_new_tokens=4), io.StringIO(), io.StringIO()
    assert chat.limit == 64
    messages = ["the cat", "a dog", "the sun", "my fish", "we walk"]
    for text in messages:
        chat.say(text, out, err)
        assert len(seen[-1]) + 4 <= 64
        assert seen[-1] == their_prompt(dirs["gpt2"], chat.messages()[:-1])  # what was read: the kept history
    notes = err.getvalue().splitlines()
    assert notes and all("left out its" in note and "max_positions=64" in note for note in notes)
    assert chat.messages()[0] == {"role": "system", "content": "hi"}
    kept = [turn["content"] for turn in chat.turns if turn["role"] == "user"]
    assert kept == messages[-len(kept):] and 1 <= len(kept) < len(messages)
    dropped = len(messages) - len(kept)
    assert sum(int(note.split("left out its ")[1].split()[0]) for note in notes) == dropped


def test_a_message_too_long_even_alone_is_refused_and_the_chat_goes_on(dirs):
    chat, out, err = chat_of(dirs["gpt2"], max_new_tokens=2), io.StringIO(), io.StringIO()
    assert chat.run(["the cat", "the cat sat on the mat " * 8, "a dog"], out, err) == 0
    assert "fewer words" in err.getvalue() and len(err.getvalue().splitlines()) == 1
    assert [turn["content"] for turn in chat.turns if turn["role"] == "user"] == ["the cat", "a dog"]
    assert out.getvalue() == "".join(turn["content"] + "\n" for turn in chat.turns if turn["role"] == "assistant")
