"""``hybridrt chat``: an interactive conversation on one engine session.

Each turn reuses the session's cache: the next prompt is built as the previous prompt's ids +
the answer's ids + the template's text for the new user turn, so the engine only prefills
the new tokens. That is checked against the chat template every turn (some templates, Qwen3's
among them, render past answers differently from how they were generated, e.g. without the
think block); where the texts differ the whole conversation is re-templated and the engine
recomputes what it cannot reuse.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from hybridrt.cli.common import (
    USAGE_ERROR,
    CliError,
    FrequencyOpt,
    MinPOpt,
    PresenceOpt,
    RepetitionOpt,
    SeedOpt,
    StopOpt,
    TemperatureOpt,
    ThinkOpt,
    TopKOpt,
    TopPOpt,
    error_line,
    load_llm,
    sampling_defaults,
    sampling_overrides,
    template_kwargs,
    weights_name,
)
from hybridrt.cli.options import ModelOptions, model_options
from hybridrt.cli.terminal import quiet_input
from hybridrt.reasoning import ReasoningDelta

_SENTINEL = "\x00hybridrt-answer\x00"

HELP = """commands:
  /exit, /bye           leave (Ctrl-D too)
  /clear                forget the conversation (keeps the system prompt)
  /regen                regenerate the last answer
  /system [text]        set (or with no text, remove) the system prompt; starts over
  /set [param value]    change a setting, or list them all with their values:
                        temperature, top_p, top_k, min_p, presence_penalty,
                        frequency_penalty, repetition_penalty, seed (int or none),
                        max_tokens (int or none), stop (a string, \\n for a newline,
                        or none), speculative_tokens
  /stats                token counts and speeds of the last answer
  /image PATH           show the model an image with the next message (a model with a
                        vision tower only; pasting the path of an image file does the same)
  /help                 this list
A message is one line; a paste of several lines is one message; end a line with \\ to
continue it, or put the text between two \"\"\" lines.
Ctrl-C stops an answer (what was generated stays in the conversation); keys typed while an
answer streams are dropped."""

_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
_INT_PARAMS = ("top_k", "seed", "max_tokens")
_NONE_OK = ("seed", "max_tokens", "stop")
# what /set changes, in the order /set and /help list them
SETTABLE = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "seed", "max_tokens", "stop",
            "speculative_tokens")


# Thinking text -------------------------------------------------------------------------------
class Renderer:
    """Writes an answer's pieces to stdout: the think block dimmed (on a terminal), between
    <think> and </think> lines (in a pipe), or hidden."""

    def __init__(self, out, color: bool, hide_thinking: bool):
        self.out, self.color, self.hide = out, color, hide_thinking
        self.in_think = False
        self.last_char = "\n"

    def start(self) -> None:
        self.in_think = False
        self.last_char = "\n"

    def write(self, pieces: list[tuple[bool, str]]) -> None:
        for thinking, text in pieces:
            if thinking:
                if self.hide:
                    continue
                if not self.in_think:
                    self.in_think = True
                    if not self.color:
                        self._put("<think>\n")
                self._put(self.dim(text))
                continue
            if self.in_think:
                self.in_think = False
                self._put("\n\n" if self.color else "\n</think>\n\n")
            self._put(text)
        self.out.flush()

    def end(self) -> None:
        """The answer is over: close a think block it did not close (cut short)."""
        if self.in_think:
            self.in_think = False
            self._put("" if self.color else "\n</think>")
        self.out.flush()

    def _put(self, text: str) -> None:
        if text:
            self.out.write(text)
            self.last_char = text[-1]

    def dim(self, line: str) -> str:
        return f"\x1b[2m{line}\x1b[22m" if self.color else line


# Prompt ids ----------------------------------------------------------------------------------
@dataclass
class Conversation:
    """The messages (for the template) and the token ids of the last turn (for the cache)."""

    tokenizer: Any
    eos_token_ids: list[int]
    template_kwargs: dict
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    prompt_ids: list[int] | None = None  # the last turn's prompt
    answer_ids: list[int] | None = None  # its answer (ending with eos when it stopped there)
    last_build: str = ""  # "first", "incremental" or "re-templated"
    # Where the last prompt's generation prompt starts: the engine saves the GDN state there,
    # so a template that re-renders the answer differently next turn still reuses the rest.
    gen_start: int | None = None
    _stable: bool | None = None  # see _prefix_stable
    # images (paths) shown with the next user message, as image parts before its text
    pending_images: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.prompt_ids = self.answer_ids = self.gen_start = None

    def template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True,
                                                  **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def user_message(self, user_text: str) -> dict:
        """A user turn: its text, after the pending images' parts."""
        if not self.pending_images:
            return {"role": "user", "content": user_text}
        return {"role": "user", "content": [
            *({"type": "image", "image": p} for p in self.pending_images),
            {"type": "text", "text": user_text}]}

    def images(self) -> list[str]:
        """The images of the conversation's messages, in order."""
        return [p["image"] for m in self.messages if isinstance(m["content"], list)
                for p in m["content"] if p.get("type") == "image"]

    def prompt_for(self, user_text: str) -> tuple[list[int], str]:
        """-> (prompt ids, prompt text) for a new user turn after the current messages (an
        image's placeholder not yet expanded to its tokens: ``LLM`` expands it)."""
        messages = [*self.messages, self.user_message(user_text)]
        text = self.template(messages)
        ids = None
        if self.prompt_ids is not None and self.answer_ids is not None:
            ids = self._incremental(user_text, text)
            self.last_build = "incremental" if ids is not None else "re-templated"
        else:
            self.last_build = "first"
        if ids is None:
            ids = self.encode(text)
        self.gen_start = None if self._prefix_stable() else self._generation_start(messages, ids)
        return ids, text

    def _prefix_stable(self) -> bool:
        """Does the template render a conversation as a prefix of its continuation? Then the
        default snapshot (before the last prompt token) serves /regen best; otherwise the
        snapshot goes where the generation prompt starts, where the next turn diverges."""
        if self._stable is None:
            user = [{"role": "user", "content": "x"}]
            first = self.template(user)
            later = self.template([*user, {"role": "assistant", "content": _SENTINEL},
                                   {"role": "user", "content": "y"}])
            self._stable = later.startswith(first + _SENTINEL)
        return self._stable

    def _generation_start(self, messages: list[dict], ids: list[int]) -> int | None:
        base = self.encode(self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, **self.template_kwargs))
        ok = 0 < len(base) < len(ids) and ids[:len(base)] == base
        return len(base) if ok else None

    def _incremental(self, user_text: str, text: str) -> list[int] | None:
        probe = self.template([*self.messages[:-1],
                               {"role": "assistant", "content": _SENTINEL},
                               self.user_message(user_text)])
        at = probe.rfind(_SENTINEL)
        if at < 0:
            return None
        suffix = probe[at + len(_SENTINEL):]
        answer = self.answer_ids
        if answer and answer[-1] in self.eos_token_ids:
            eos_text = self.decode(answer[-1:])
            if eos_text and suffix.startswith(eos_text):
                suffix = suffix[len(eos_text):]
        ids = self.prompt_ids + answer + (self.encode(suffix) if suffix else [])
        return ids if self.decode(ids) == text else None

    def drop_oldest_turn(self) -> bool:
        """Forget the oldest user message and the answer to it (the system prompt stays); the
        next prompt is templated afresh. -> False when there is nothing left to drop."""
        start = 1 if self.messages and self.messages[0]["role"] == "system" else 0
        if start >= len(self.messages):
            return False
        end = start + 1
        while end < len(self.messages) and self.messages[end]["role"] != "user":
            end += 1
        del self.messages[start:end]
        self.prompt_ids = self.answer_ids = None
        return True

    def commit(self, prompt_ids: list[int], answer_ids: list[int]) -> None:
        body = answer_ids[:-1] if answer_ids and answer_ids[-1] in self.eos_token_ids \
            else answer_ids
        self.messages.append({"role": "assistant", "content": self.decode(body)})
        self.prompt_ids, self.answer_ids = list(prompt_ids), list(answer_ids)


# The loop ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _sigint_flag():
    """While streaming, Ctrl-C sets a flag instead of raising inside an engine step."""
    flag = {"hit": False}
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return

    def on_sigint(signum, frame):
        flag["hit"] = True

    old = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, old)


class ChatLoop:
    def __init__(self, llm, sampling: dict, speculative_tokens: int, system: str | None,
                 think: bool | None, hide_thinking: bool, stdin=None, stdout=None):
        if llm.tokenizer is None:
            raise CliError(f"{llm.model_path} has no tokenizer: chat needs one", USAGE_ERROR)
        if not getattr(llm.tokenizer, "chat_template", None):
            raise CliError(f"the tokenizer of {llm.model_path} has no chat template",
                           USAGE_ERROR)
        self.llm = llm
        self.sampling = dict(sampling)
        self.k = speculative_tokens
        self.stdin = stdin or sys.stdin
        self.out = stdout or sys.stdout
        self.interactive = self.stdin.isatty()
        self.render = Renderer(self.out, color=self.out.isatty(), hide_thinking=hide_thinking)
        self.conv = Conversation(llm.tokenizer, list(llm.config.eos_token_ids),
                                 template_kwargs(think), system)
        self.session = llm.open_session()
        self.last: dict | None = None  # /stats of the last answer

    # Input ----------------------------------------------------------------------------------
    def read(self) -> str | None:
        """One message -> its text, None at the end of input. A message is a line; in a
        terminal, with the other lines of a paste; lines joined by a trailing backslash; or a
        block between \"\"\" lines. Ctrl-C while typing drops the message ('')."""
        try:
            line = self._line(">>> ")
            if line is None:
                return None
            if self.interactive:
                while self._more_pending():  # the rest of a paste is already waiting
                    more = self._line("")
                    if more is None:
                        break
                    line += "\n" + more
            if line.lstrip().startswith('"""'):
                return self._block(line.lstrip()[3:])
            while line.endswith("\\"):
                more = self._line("... ")
                if more is None:
                    break
                line = line[:-1] + "\n" + more
            return line
        except KeyboardInterrupt:
            self.out.write("\n(/exit or Ctrl-D to quit)\n")
            return ""

    def _block(self, text: str) -> str:
        """The text after an opening \"\"\", up to the closing one (or the end of input)."""
        lines = []
        while text is not None:
            if text.rstrip().endswith('"""'):
                lines.append(text.rstrip()[:-3])
                break
            lines.append(text)
            text = self._line("... ")
        return "\n".join(lines)

    def _line(self, prompt: str) -> str | None:
        if self.interactive:
            try:
                return input(prompt)
            except EOFError:
                self.out.write("\n")
                return None
        line = self.stdin.readline()
        return None if line == "" else line.rstrip("\r\n")

    def _more_pending(self) -> bool:
        """Is input already waiting (so it arrived with the line just read, as a paste)?"""
        import select

        try:
            return bool(select.select([self.stdin], [], [], 0.02)[0])
        except (OSError, ValueError, TypeError):
            return False

    def run(self) -> None:
        if self.interactive:
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401 - line editing and history for input()
            typer.echo(banner(self.llm), err=True)
        try:
            while True:
                line = self.read()
                if line is None:
                    break
                line = line.strip()
                if not line:
                    continue
                with quiet_input(self.stdin):  # until the answer (or command) is done
                    if _image_file(line) and self.llm.vision is not None:
                        refused = self.attach(line)  # a pasted (or dropped) image path
                        if refused:
                            error_line(refused)
                    elif line.startswith("/"):
                        if not self.command(line):
                            break
                    else:
                        self.turn(line)
        finally:
            if not self.session.busy:
                self.llm.close_session(self.session)

    # Commands -------------------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command -> False to leave the chat."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/help":
            self.say(HELP)
        elif name == "/clear":
            self.llm.reset_session(self.session)
            self.conv.clear()
            self.say("(conversation cleared)")
        elif name == "/regen":
            self.regenerate()
        elif name == "/system":
            self.conv.system = arg or None
            self.llm.reset_session(self.session)
            self.conv.clear()
            self.say("(system prompt set; new conversation)" if arg
                     else "(system prompt removed; new conversation)")
        elif name == "/set":
            self.set_param(arg)
        elif name == "/stats":
            self.show_stats()
        elif name == "/image":
            refused = self.attach(arg)
            if refused:
                error_line(refused)
        else:
            error_line(f"unknown command {name} (/help lists them)")
        return True

    def attach(self, path: str, what: str = "/image") -> str | None:
        """Show the image at ``path`` with the next message -> None, or why it was not
        taken."""
        from hybridrt.vision.preprocess import load_image

        path = path.strip().strip("'\"")
        if self.llm.vision is None:
            return f"{what} {path}: refused, {self.llm.vision_refusal}"
        try:
            image = load_image(path)
        except ValueError as e:
            return f"{what}: {e}"
        self.conv.pending_images.append(path)
        self.say(self.render.dim(f"(image {path}, {image.width}x{image.height}: shown with "
                                 f"the next message)"))
        return None

    def settings(self) -> dict[str, Any]:
        """Every /set parameter -> its current value (the SamplingParams default if unset)."""
        from hybridrt.sampling_params import SamplingParams

        p = SamplingParams(**self.sampling)
        values = {name: getattr(p, name) for name in SETTABLE if name != "speculative_tokens"}
        return {**values, "speculative_tokens": self.k}

    def set_param(self, arg: str) -> None:
        from hybridrt.sampling_params import SamplingParams

        if not arg:
            self.say("\n".join(f"  {k:<20} {_show(v)}" for k, v in self.settings().items()))
            return
        name, _, raw = arg.partition(" ")
        name, raw = name.replace("-", "_"), raw.strip()
        if not raw or (name != "stop" and len(raw.split()) != 1):
            error_line("usage: /set <param> <value>, e.g. /set temperature 0.7 (/set lists "
                       "the parameters)")
            return
        try:
            if name == "speculative_tokens":
                k = int(raw)
                limit = self.llm.engine.speculative_tokens
                if not 0 <= k <= limit:
                    raise ValueError(f"speculative_tokens must be in [0, {limit}]"
                                     + (" (start the chat with --speculative-tokens N to "
                                        "raise the limit)" if k > limit else "")
                                     + f", got {k}")
                self.k = k
                self.say(f"speculative_tokens={k}")
                return
            if name in _NONE_OK and raw.lower() == "none":
                value = None
            elif name == "stop":
                value = [raw.replace("\\n", "\n").replace("\\t", "\t")]
            elif name in _FLOAT_PARAMS:
                value = float(raw)
            elif name in _INT_PARAMS:
                value = int(raw)
            else:
                raise ValueError(f"unknown setting {name!r}; one of {', '.join(SETTABLE)}")
            new = {**self.sampling, name: value}
            SamplingParams(**new)
        except ValueError as e:
            msg = str(e)
            if msg.startswith(("invalid literal", "could not convert")):
                msg = f"{name}: {raw!r} is not a valid number"
            error_line(msg)
            return
        self.sampling = new
        self.say(f"{name}={_show(value)}")

    def show_stats(self) -> None:
        if self.last is None:
            self.say("(no answer yet)")
            return
        s = self.last
        rows = [("prompt tokens", s["prompt_tokens"]), ("prefilled tokens", s["prefilled"]),
                ("reused tokens", s["reused"]), ("generated tokens", s["generated"]),
                ("prompt tok/s", _num(s["prompt_tok_s"])),
                ("generation tok/s", _num(s["gen_tok_s"])),
                ("acceptance length", _num(s["acceptance"])),
                ("prompt built", s["built"]), ("finish reason", s["finish_reason"])]
        self.say("\n".join(f"  {k:<18} {v}" for k, v in rows))

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # Turns ----------------------------------------------------------------------------------
    def turn(self, user_text: str) -> None:
        try:
            fitted = self.fit(user_text)
        except Exception as e:  # noqa: BLE001 - a template may raise anything
            error_line(f"chat template: {e}")
            return
        if fitted is None:
            return
        ids, user_text = fitted
        self.conv.messages.append(self.conv.user_message(user_text))
        answer = self.answer(ids)
        if answer is None:
            self.conv.messages.pop()
            return
        self.conv.pending_images = []
        self.conv.commit(ids, answer)

    def fit(self, user_text: str) -> tuple[list[int], str] | None:
        """The prompt for a new user message, within max_model_len with room for an answer
        (max_tokens, at most a quarter of the context): the oldest turns are dropped (the
        system prompt stays) and, if the message alone is too long, only its end is kept; one
        dim line says so. -> (prompt ids, the message as sent), None if even the system prompt
        leaves no room."""
        limit = self.llm.engine.engine_config.max_model_len
        max_tokens = self.sampling.get("max_tokens") or limit
        budget = limit - max(1, min(max_tokens, limit // 4))
        conv = self.conv
        ids, _ = conv.prompt_for(user_text)
        dropped = 0
        while len(ids) > budget and conv.drop_oldest_turn():
            dropped += 1
            ids, _ = conv.prompt_for(user_text)
        notes = []
        if dropped:
            notes.append("dropped the oldest turn" if dropped == 1
                         else f"dropped the {dropped} oldest turns")
        if len(ids) > budget:
            msg_ids = conv.encode(user_text)
            keep = len(msg_ids) - (len(ids) - budget)
            while keep >= 1:
                user_text = conv.decode(msg_ids[-keep:])
                ids, _ = conv.prompt_for(user_text)
                if len(ids) <= budget:
                    break
                keep -= len(ids) - budget
            if len(ids) >= limit or keep < 1:
                error_line(f"the system prompt leaves no room for a message within "
                           f"max_model_len {limit}: shorten it with /system")
                return None
            notes.append(f"kept the last {keep} of the message's {len(msg_ids)} tokens")
        if notes:
            self.say(self.render.dim(f"(context limit {limit} tokens: {'; '.join(notes)})"))
        return ids, user_text

    def regenerate(self) -> None:
        conv = self.conv
        if conv.prompt_ids is None or not conv.messages or \
                conv.messages[-1]["role"] != "assistant":
            error_line("nothing to regenerate yet")
            return
        old = conv.messages.pop()
        conv.last_build = "same as before (regenerate)"
        answer = self.answer(conv.prompt_ids)
        if answer is None:
            conv.messages.append(old)
            return
        conv.commit(conv.prompt_ids, answer)

    def answer(self, ids: list[int]) -> list[int] | None:
        """Stream one answer -> its token ids (None when the request was refused)."""
        from hybridrt.sampling_params import SamplingParams

        params = SamplingParams(**self.sampling)
        self.render.start()
        images = self.conv.images()
        prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images \
            else ids
        stream = self.llm.stream(prompt, params, session=self.session,
                                 speculative_tokens=self.k, snapshot_at=self.conv.gen_start)
        interrupted = False
        with _sigint_flag() as flag:
            try:
                for delta in stream:
                    self.render.write([(isinstance(delta, ReasoningDelta), delta)])
                    if flag["hit"]:
                        interrupted = True
                        break
            except ValueError as e:  # refused before it started (too long, ...)
                error_line(e)
                return None
            except KeyboardInterrupt:
                interrupted = True
            finally:
                stream.close()
        self.render.end()
        out = self.llm.last_stream_output
        if self.render.last_char != "\n":
            self.out.write("\n")
        self.last = _turn_stats(out, self.session.last_reused_tokens, self.conv.last_build)
        self.say(self.render.dim(_summary(self.last, interrupted)))
        return list(out.outputs[0].token_ids)


DEMO_NOTE = ("  the embedded demo model: 8.4M parameters trained for an hour on Python "
             "docstrings, not an\n  assistant. Ask it what a stdlib function does, e.g. "
             "What does json.dumps do?\n  Its vision tower names a picture's shape and colour: "
             "/image {png}")


_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")


def _image_file(line: str) -> bool:
    """Is the line just the path of an image file (as a terminal pastes a dropped file)?"""
    path = Path(line.strip().strip("'\"")).expanduser()
    return path.suffix.lower() in _IMAGE_SUFFIXES and path.is_file()


def banner(llm) -> str:
    """What an interactive chat starts with: the model and how it runs."""
    import torch

    from hybridrt.llm import DEMO_MODEL_DIR

    device = llm.device
    where = f"{device}, {torch.get_num_threads()} threads" if device.type == "cpu" \
        else str(device)
    loaded = getattr(llm, "load_seconds", None)
    cache = llm.cache_sizing.total_bytes / 2**20
    lines = [f"hybridrt chat: {llm.model_path} ({weights_name(llm)}, {where}, context "
             f"{llm.engine.engine_config.max_model_len} tokens"
             + (f", loaded in {loaded:.1f}s)" if loaded is not None else ")"),
             f"  cache: up to {cache:.0f} MiB of KV blocks and GDN states, taken as it is used"]
    if Path(llm.model_path).resolve() == DEMO_MODEL_DIR.resolve():
        lines.append(DEMO_NOTE.format(png=DEMO_MODEL_DIR / "demo.png"))
    lines.append("/help lists the commands, Ctrl-D quits")
    return "\n".join(lines)


def _turn_stats(out, reused: int, built: str) -> dict:
    m = out.metrics
    ttft = m.get("time_to_first_token")
    prefilled = m.get("num_prefilled_tokens", 0)
    spec = m.get("spec")
    return {
        "prompt_tokens": m.get("num_prompt_tokens", len(out.prompt_token_ids)),
        "prefilled": prefilled, "reused": reused,
        "generated": m.get("num_generated_tokens", len(out.outputs[0].token_ids)),
        "prompt_tok_s": prefilled / ttft if ttft else None,
        "gen_tok_s": m.get("decode_tokens_per_s"),
        "acceptance": spec["mean_acceptance_length"] if spec and spec.get("num_rounds") else None,
        "built": built, "finish_reason": out.outputs[0].finish_reason,
    }


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, (str, list)) else str(value)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _summary(s: dict, interrupted: bool) -> str:
    parts = [f"prompt {_num(s['prompt_tok_s'])} tok/s", f"generation {_num(s['gen_tok_s'])} tok/s"]
    if s["acceptance"] is not None:
        parts.append(f"acceptance {s['acceptance']:.2f}")
    return "[" + " | ".join(parts) + ("] (interrupted)" if interrupted else "]")


# The command ---------------------------------------------------------------------------------
@model_options(max_num_seqs=2)
def chat(
    options: ModelOptions,
    system: Annotated[str | None, typer.Option(
        "--system", help="System prompt (default: none).", show_default=False)] = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    presence_penalty: PresenceOpt = None,
    frequency_penalty: FrequencyOpt = None,
    repetition_penalty: RepetitionOpt = None,
    seed: SeedOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1,
                                            help="Most tokens per answer.")] = 1024,
    stop: StopOpt = None,
    think: ThinkOpt = None,
    show_thinking: Annotated[bool, typer.Option(
        "--show-thinking/--hide-thinking",
        help="Show the text between <think> and </think> (dimmed on a terminal).")] = True,
    image: Annotated[list[str] | None, typer.Option(
        "--image", help="An image file shown to the model with the first message (a model "
                        "with a vision tower only; repeat for more) (default: none).",
        show_default=False)] = None,
) -> None:
    """Chat with a model; answers stream as they are generated.

    The conversation stays in the engine's cache between turns. Reads lines from stdin when it
    is not a terminal; /help lists the in-chat commands.
    """

    options = options.checked()
    flags = sampling_overrides(max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               min_p=min_p, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty,
                               repetition_penalty=repetition_penalty, seed=seed,
                               stop=stop or None)
    llm = load_llm(options, announce=False)
    sampling = {**sampling_defaults(llm.model_path), **flags, "max_tokens": max_tokens}
    loop = ChatLoop(llm, sampling, options.speculative_tokens, system, think, not show_thinking)
    for path in image or ():
        refused = loop.attach(path, "--image")
        if refused:
            llm.close_session(loop.session)
            raise CliError(refused, USAGE_ERROR)
    loop.run()
