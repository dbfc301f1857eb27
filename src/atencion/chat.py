"""`atencion chat`: a conversation in the terminal with an instruct model, a decoder-only model
whose Hugging Face tokenizer has a chat template (SmolLM-Instruct, Qwen2-Instruct, ...).

Each turn the whole history (the system message first, if one is given) goes through the chat
template with the assistant's prompt at its end, as transformers' ``apply_chat_template`` writes
it, and the reply is sampled (decode/sample.py) until a stop token or --max-new-tokens, shown as
it comes (decode/text.py holds back a character whose bytes are not all there yet) and kept in
the history. The model reads the rendered history afresh each turn, with no cache kept between
turns: the reply is read back as the template writes it, as the model saw its training chats.

A history that would pass a learned position table (with room for a reply of --max-new-tokens)
loses its oldest exchanges, said in one line on stderr; the system message stays. Ctrl-C stops
the reply being written (what was shown is kept as the assistant's turn) and the chat goes on;
at the prompt it ends the chat with status 0, as end of input (Ctrl-D), /exit and /quit do.

torch is imported when a chat starts: ``atencion --help`` does not load it.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TextIO

from .arguments import COUNT, add_sampling_arguments, bounded
from .errors import AtencionError

PROMPT = "> "  # shown before each line the user types, on a terminal only
COMMAND = re.compile(r"/\S+")  # a line that is one /word is a command, not a message
COMMANDS_HELP = "/reset forgets the history (the system message stays), /exit or /quit ends the chat (as Ctrl-D does)"


def check_chat_model(model, tokenizer, where: str) -> None:
    """Refuse, in one line naming ``where`` (e.g. "--model DIR"), a model that cannot chat: one
    that is not decoder-only, or whose tokenizer has no chat template to write the turns with."""
    from .tasks import TASKS
    from .tasks.base import describe, model_task
    from .tasks.lm import can_generate

    if tokenizer is None or not can_generate(model, tokenizer):
        raise AtencionError(f"{where} is {describe(model.cfg)}: chat needs a decoder-only model (arch decoder) "
                            f"whose tokenizer has a chat template; use atencion {TASKS[model_task(model.cfg)].use}")
    if tokenizer.chat_template is None:
        raise AtencionError(f"{where} has no chat template (chat_template.jinja, or chat_template in "
                            f"tokenizer_config.json) to write the turns with: continue plain text with "
                            f"atencion generate")


class Chat:
    """A conversation with a decoder-only ``model`` through its ``tokenizer``'s chat template:
    ``say`` answers one message of the user's, ``reset`` forgets the history, ``run`` is the loop
    of the command over lines. ``turns`` holds the user's and the assistant's turns in order, as
    {"role", "content"} messages (``messages`` puts the system message before them). Sampling as
    ``generate_ids``: ``temperature`` 0 is greedy; ``seed`` None draws a fresh one. ``where``
    names the model in messages. Settings that cannot work are refused here, before any turn:
    bad sampling settings, a template that does not render the system message, and a reply of
    ``max_new_tokens`` that cannot fit in the model's context (``context_length``) after the system message."""

    def __init__(self, model, tokenizer, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.7, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 where: str = "--model"):
        from .data.tokenizer import check_text
        from .decode.sample import check_sampling
        from .nn.positional import context_length

        check_chat_model(model, tokenizer, where)
        check_sampling(temperature, top_k, top_p)
        self.model, self.tokenizer, self.where = model, tokenizer, where
        self.system = None if system is None else check_text(system, "--system")
        self.max_new_tokens, self.sampling = max_new_tokens, (temperature, top_k, top_p)
        self.limit = context_length(model.cfg)  # RoPE's too: the context it was made for
        specials = tokenizer.specials
        stop = specials.stop or ((specials.eos,) if specials.eos is not None else ())
        self.stop = [i for i in stop if 0 <= i < model.cfg.vocab_size]  # ids past the vocabulary never come
        self.generator = _generator(model, seed)
        self.turns: list[dict[str, str]] = []
        self._check_room()

    def messages(self) -> list[dict[str, str]]:
        """The history as the chat template reads it: the system message, if any, then the turns."""
        return self._head() + self.turns

    def prompt_ids(self, messages: list[dict[str, str]] | None = None) -> list[int]:
        """The ids the model reads: ``messages`` (default: the history) through the chat template,
        with the assistant's prompt at the end, encoded as ``apply_chat_template`` encodes it (the
        special tokens it writes as text become their ids; none is added)."""
        return self.tokenizer.encode(self.tokenizer.src.render_chat(self.messages() if messages is None else messages))

    def reset(self) -> None:
        """Forget the turns; the system message stays."""
        self.turns.clear()

    def say(self, text: str, out: TextIO, err: TextIO | None = None) -> str:
        """Answer the user's ``text``: it joins the history, the reply is written to ``out`` as it
        is generated (then a line break) and joins the history too. Returns the reply. Oldest
        exchanges the positions cannot hold any more are left out, said on ``err`` (default:
        stderr). A KeyboardInterrupt while the reply is written stops it: the text shown so far is
        the reply. A message that cannot fit even alone is refused (AtencionError) and forgotten."""
        from .data.tokenizer import check_text

        self.turns.append({"role": "user", "content": check_text(text, "the message")})
        try:
            ids = self._fit(sys.stderr if err is None else err)
            reply = self._reply(ids, out)
        except BaseException:  # refused, or stopped before the reply began: the message is forgotten
            del self.turns[-1]
            raise
        self.turns.append({"role": "assistant", "content": reply})
        return reply

    def run(self, lines: Iterable[str], out: TextIO, err: TextIO) -> int:
        """The chat over ``lines`` (what the user types, one message or command a line): replies on
        ``out``, notes and refusals on ``err``. Ends at the end of the lines, at /exit or /quit, or
        at a KeyboardInterrupt while waiting for a line (a line break is written); returns 0."""
        lines = iter(lines)
        while True:
            try:
                line = next(lines)
            except StopIteration:
                return 0
            except KeyboardInterrupt:
                _write(out, "\n")
                return 0
            if not self.turn(line, out, err):
                return 0

    def turn(self, line: str, out: TextIO, err: TextIO) -> bool:
        """One line of the user's: a command (``command``), an empty line (nothing), or a message to
        answer (``say``), whose refusal is one line on ``err``. False when the chat ends."""
        text = line.rstrip("\r\n")
        if COMMAND.fullmatch(text.strip()):
            return self.command(text.strip(), err)
        if not text.strip():
            return True
        try:
            self.say(text, out, err)
        except AtencionError as error:
            print(f"atencion chat: {error}", file=err, flush=True)
        except KeyboardInterrupt:  # before the reply began (while the history was read)
            _write(out, "\n")
        return True

    def command(self, word: str, err: TextIO) -> bool:
        """Do the command ``word`` (/reset, /exit, /quit, /help); False when the chat ends. An
        unknown one is answered with the list of commands."""
        name = word.lower()
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.reset()
            print("atencion chat: history forgotten" + (" (the system message stays)" if self.system else ""),
                  file=err, flush=True)
        elif name == "/help":
            print(f"atencion chat: {COMMANDS_HELP}", file=err, flush=True)
        else:
            print(f"atencion chat: unknown command {word}: {COMMANDS_HELP}", file=err, flush=True)
        return True

    # ------------------------------------------------------------------------------------------

    def _head(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    def _fits(self, ids: list[int]) -> bool:
        return self.limit is None or len(ids) + self.max_new_tokens <= self.limit

    def _check_room(self) -> None:
        """Render the system message and an empty message once: a template that refuses them (a
        system role it does not know, say) is refused now, and so is a --max-new-tokens that leaves
        no room for a message in the model's context."""
        ids = self.prompt_ids([*self._head(), {"role": "user", "content": ""}])
        if not self._fits(ids):
            room = self.limit - len(ids)
            fix = f"give at most {room - 1}" if room > 1 else "give a shorter --system"
            raise AtencionError(f"--max-new-tokens {self.max_new_tokens}: the chat template takes {len(ids)} tokens "
                                f"before the first message and the model's context stops at "
                                f"max_positions={self.limit}; {fix}")

    def _fit(self, err: TextIO) -> list[int]:
        """The ids of the history, its oldest exchanges left out (one line on ``err`` says how many)
        until a reply of max_new_tokens fits in the context; refused when the last
        message does not fit even alone (the history is then kept as it was)."""
        ids = self.prompt_ids()
        if self._fits(ids):
            return ids
        alone = self.prompt_ids([*self._head(), self.turns[-1]])
        if not self._fits(alone):
            raise AtencionError(f"this message takes {len(alone)} tokens with the chat template, and with a reply of "
                                f"--max-new-tokens {self.max_new_tokens} it passes the model's context "
                                f"(max_positions={self.limit}); say it in fewer words, or lower --max-new-tokens")
        dropped = 0
        while not self._fits(ids):
            del self.turns[:2]  # the oldest message and its reply
            dropped += 1
            ids = self.prompt_ids()
        print(f"atencion chat: the history passes the model's context (max_positions={self.limit}) with "
              f"room for a reply of --max-new-tokens {self.max_new_tokens}: left out its {dropped} oldest "
              f"exchange{'s' if dropped > 1 else ''}" + (" (the system message stays)" if self.system else ""),
              file=err, flush=True)
        return ids

    def _reply(self, ids: list[int], out: TextIO) -> str:
        """The model's reply to the prompt ``ids``, written to ``out`` as it comes, then a line
        break; a KeyboardInterrupt stops it, and the text shown so far is the reply."""
        import torch

        from .decode.sample import generate_ids
        from .decode.text import TextStream
        from .tasks.base import model_device

        stream, stops = TextStream(self.tokenizer.decode), set(self.stop)

        def show(step: int, tokens) -> None:
            token = int(tokens[0])
            if token not in stops:  # the stop token ends the reply; it is not part of it
                _write(out, stream.push(token))

        rows = torch.tensor([ids], dtype=torch.long, device=model_device(self.model))
        try:
            generate_ids(self.model, rows, self.max_new_tokens, *self.sampling, self.generator, self.stop or None,
                         on_step=show)
        except KeyboardInterrupt:
            reply = stream.text[:stream.shown]
        else:
            _write(out, stream.close())
            reply = stream.text
        _write(out, "\n")
        return reply


def _generator(model, seed: int | None):
    """The sampler's own random numbers, on the model's device: from ``seed``, or a fresh seed."""
    import torch

    from .tasks.base import model_device

    generator = torch.Generator(model_device(model))
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def _write(out: TextIO, text: str) -> None:
    if text:
        out.write(text)
        out.flush()


def terminal_lines(prompt: str = PROMPT, err: TextIO | None = None) -> Iterator[str]:
    """What the user types on a terminal, a line at a time, after ``prompt`` (with line editing
    and recall where Python has readline), until end of input (Ctrl-D). A line whose bytes are
    not the terminal's encoding is skipped, said on ``err`` (default: stderr)."""
    try:
        import readline  # noqa: F401  (input() then edits and recalls lines)
    except ImportError:
        pass
    while True:
        try:
            yield input(prompt)
        except EOFError:
            sys.stdout.write("\n")
            return
        except UnicodeDecodeError:
            print("atencion chat: that line was not UTF-8 text; type it again", file=err or sys.stderr, flush=True)


def piped_lines(source, err: TextIO | None = None) -> Iterator[str]:
    """The lines of the binary stream ``source`` (stdin when it is not a terminal), as UTF-8: bytes
    that are not are replaced (U+FFFD), said once per line on ``err`` (default: stderr)."""
    for number, raw in enumerate(source, start=1):
        if isinstance(raw, str):  # a text stream (stdin replaced by one): decoded already
            yield raw
            continue
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            print(f"atencion chat: warning: stdin line {number} is not UTF-8; its bad bytes were replaced",
                  file=err or sys.stderr, flush=True)
            yield raw.decode("utf-8", errors="replace")


@contextmanager
def plain_ctrl_c():
    """Within the block, Ctrl-C raises KeyboardInterrupt where the chat is, as Python's own handler
    does: the command line's handler (interrupt.py) also remembers it and raises it again when the
    command ends, which would end a chat that was only asked to stop a reply. Left as it is outside
    the main thread, and when SIGINT is ignored or has no Python handler (a job in the background)."""
    if threading.current_thread() is not threading.main_thread() or not callable(signal.getsignal(signal.SIGINT)):
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# the command: `atencion chat` -----------------------------------------------------------------------

def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model directory of a decoder-only model whose tokenizer has a "
                                                   "chat template (a Hugging Face instruct model, e.g. "
                                                   "SmolLM-Instruct or Qwen2-Instruct)")
    p.add_argument("--system", help="the system message, first in the history and kept by /reset (default: none; "
                                    "some templates then write their own)")
    p.add_argument("--max-new-tokens", type=bounded(int, 1, highest=1_000_000), default=256,
                   help="tokens per reply at most (default: 256)")
    add_sampling_arguments(p, 0.7, "the same replies to the same messages")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default: cpu)")
    p.add_argument("--threads", type=COUNT, default=0, help="torch threads (default: torch's choice)")


def cmd_chat(args: argparse.Namespace) -> None:
    """Chat with an instruct model: each line typed is the user's message, answered token by token
    by the model through its tokenizer's chat template, with the whole conversation (and --system
    first) as the history. /reset forgets the history (the system message stays); /exit, /quit,
    end of input (Ctrl-D) or Ctrl-C at the prompt end the chat with status 0; Ctrl-C while a
    reply is written stops that reply (kept as written) and the chat goes on. When the history
    and a reply of --max-new-tokens would pass the model's context (max_positions), its oldest
    exchanges are left out (said on stderr). The prompt '> ' is shown on a terminal only: piped
    input gives the replies alone, one a line."""
    import torch

    from .decode.sample import check_sampling
    from .nn.model_dir import load_model_dir

    check_sampling(args.temperature, args.top_k, args.top_p)  # before the model is read
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_dir(args.model, args.device)
    chat = Chat(model, tokenizer, args.system, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                args.seed, where=f"--model {args.model}")
    if sys.stdin.isatty():
        print(f"atencion chat: {args.model}; {COMMANDS_HELP}", file=sys.stderr, flush=True)
        lines = terminal_lines(PROMPT)
    else:
        lines = piped_lines(getattr(sys.stdin, "buffer", sys.stdin))
    with plain_ctrl_c():
        chat.run(lines, sys.stdout, sys.stderr)
