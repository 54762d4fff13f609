"""``hybridrt generate``: batch generation, one JSON line out per prompt in.

An input line is plain text (the prompt) or a JSON object:

    {"id": 7, "prompt": "...", "temperature": 0, "max_tokens": 32, "stop": ["\\n"]}
    {"messages": [{"role": "user", "content": "..."}], "seed": 3,
     "chat_template_kwargs": {"enable_thinking": true}}

Besides ``id`` and one of ``prompt`` / ``messages`` / ``prompt_token_ids`` a line may carry
any SamplingParams field and ``chat_template_kwargs``; command-line flags are the defaults.
A message's content is text or OpenAI content parts; image parts (a data URL or a path) go to
the vision tower as in ``LLM.chat`` (docs/vision.md).
A line that starts with ``{``, ``[`` or ``"`` and parses as JSON must be an object (a JSON
string or list is an error, not a prompt); blank lines are skipped. Without an ``id`` a line's
id is its 0-based position in the output: the ``--prompt`` texts first, then the input's
non-blank lines. A line that cannot be used (bad JSON, unknown field, invalid value) gets
``{"id": ..., "error": "line N: ..."}`` in its place, N being its 1-based line number in the
input.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer

from hybridrt.cli.common import (
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
    load_llm,
    sampling_defaults,
    sampling_overrides,
    template_kwargs,
)
from hybridrt.cli.options import ModelOptions, model_options

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
_JSON_KINDS = {str: "string", list: "list", int: "number", float: "number", bool: "boolean"}


def _sampling_fields() -> tuple[str, ...]:
    from hybridrt.sampling_params import SamplingParams

    return tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclasses.dataclass
class Item:
    """One prompt with its sampling fields, or the reason it cannot run."""

    id: Any
    where: str  # "line N" of the input, or "--prompt N"
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    sampling: dict = dataclasses.field(default_factory=dict)
    chat_kwargs: dict | None = None
    error: str | None = None
    plain: bool = False  # plain text (a --prompt or a non-JSON line): --chat templates it

    def error_record(self, message: str) -> dict:
        return {"id": self.id, "error": f"{self.where}: {message}"}


def parse_line(line: str, index: int, line_number: int,
               sampling_fields: tuple[str, ...]) -> Item:
    """One non-blank input line -> its Item; ``index`` is its position in the output (the
    default id)."""
    text = line.rstrip("\r\n")
    where = f"line {line_number}"
    head = text.lstrip()[:1]
    if head not in ("{", "[", '"'):
        return Item(id=index, where=where, prompt=text, plain=True)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        if head != "{":  # e.g. '"Hi," she said.' or '[draft] ...': plain text
            return Item(id=index, where=where, prompt=text, plain=True)
        return Item(id=index, where=where, error=f"invalid JSON: {e}")
    if not isinstance(obj, dict):
        kind = _JSON_KINDS.get(type(obj), type(obj).__name__)
        return Item(id=index, where=where, error=f"a JSON {kind} is not a request: write an "
                    f'object such as {{"prompt": "..."}} or {{"prompt_token_ids": [...]}}')
    item = Item(id=obj.get("id", index), where=where)
    unknown = sorted(set(obj) - {"id", "chat_template_kwargs", *PROMPT_FIELDS,
                                 *sampling_fields})
    given = [k for k in PROMPT_FIELDS if k in obj]
    kwargs = obj.get("chat_template_kwargs")
    if unknown:
        item.error = f"unknown field(s) {', '.join(map(repr, unknown))}"
    elif len(given) != 1:
        item.error = f"needs exactly one of {', '.join(PROMPT_FIELDS)}, got {given or 'none'}"
    elif kwargs is not None and not isinstance(kwargs, dict):
        item.error = "chat_template_kwargs must be an object"
    elif "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and _content(m.get("content"))
            for m in msgs
        ):
            item.error = ("messages must be a non-empty list of {'role': str, 'content': str or "
                          "a list of content parts such as {'type': 'text', 'text': ...} and "
                          "{'type': 'image_url', 'image_url': {'url': ...}}}")
        item.messages = msgs
    elif kwargs is not None:
        item.error = "chat_template_kwargs applies to messages only"
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            item.error = "prompt must be a string"
        item.prompt = obj["prompt"]
    else:
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            item.error = "prompt_token_ids must be a list of ints"
        item.prompt = ids
    item.chat_kwargs = kwargs
    item.sampling = {k: v for k, v in obj.items() if k in sampling_fields}
    return item


def _content(content) -> bool:
    """A message's content as a chat takes it: text, or OpenAI content parts (text, images:
    hybridrt.vision.inputs)."""
    return isinstance(content, str) or isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)


def as_chat(items: list) -> None:
    """--chat: each plain-text prompt becomes a user message through the chat template."""
    for it in items:
        if it.plain and it.prompt:
            it.messages = [{"role": "user", "content": it.prompt}]


def read_items(prompts: list[str], input_file: Path | None) -> list[Item]:
    """The --prompt texts, then the input's non-blank lines (file, '-' or piped stdin)."""
    fields = _sampling_fields()
    items = [Item(id=i, where=f"--prompt {i + 1}", prompt=p, plain=True)
             for i, p in enumerate(prompts)]
    lines: list[str] = []
    if input_file is not None:
        if str(input_file) == "-":
            lines = sys.stdin.read().splitlines()
        else:
            try:
                lines = input_file.read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise CliError(f"--input {input_file}: {getattr(e, 'strerror', None) or e}",
                               2) from None
    elif not prompts:
        if sys.stdin.isatty():
            raise CliError("no prompts: give --prompt TEXT, --input FILE, or pipe lines on "
                           "stdin", 2)
        lines = sys.stdin.read().splitlines()
    for number, line in enumerate(lines, 1):
        if line.strip():
            items.append(parse_line(line, len(items), number, fields))
    return items


def run_items(llm, items: list[Item], defaults: dict, chat_kwargs: dict,
              progress: bool, speculative_tokens: int | None) -> Iterator[tuple[int, dict]]:
    """Generate every runnable item in one engine run -> (item index, record) as each
    finishes; items that cannot run come first."""
    prompts, params, where = [], [], []
    for i, it in enumerate(items):
        if it.error is None and it.messages is not None:
            try:
                if llm.tokenizer is None:
                    raise ValueError("this model has no tokenizer, so it has no chat template")
                # as LLM.chat renders it: image parts become the prompt's multi_modal_data
                it.prompt = llm.inputs.chat_prompt(it.messages, {
                    **chat_kwargs, **(it.chat_kwargs or {})}, True)
            except Exception as e:  # noqa: BLE001 - a template may raise anything
                it.error = f"chat template: {e}"
        if it.error is None and it.prompt == "":
            it.error = "prompt is empty"
        if it.error is not None:
            yield i, it.error_record(it.error)
            continue
        prompts.append(it.prompt)
        params.append({**defaults, **it.sampling})
        where.append(i)
    if not prompts:
        return
    for n, out in llm.generate_iter(prompts, params, use_tqdm=progress,
                                    speculative_tokens=speculative_tokens):
        it = items[where[n]]
        if out.error is not None:
            yield where[n], it.error_record(str(out.error))
            continue
        c = out.outputs[0]
        rec = {"id": it.id, "prompt": out.prompt if out.prompt is not None else it.prompt,
               "text": c.text}
        if c.reasoning_text is not None:  # thinking on: text is the answer after the block
            rec["reasoning_text"] = c.reasoning_text
        rec.update(token_ids=c.token_ids, finish_reason=c.finish_reason, metrics=out.metrics)
        if c.logprobs is not None:
            rec["logprobs"] = [{str(t): lp for t, lp in d.items()} for d in c.logprobs]
        yield where[n], rec


@dataclasses.dataclass
class Tally:
    written: int = 0
    failed: int = 0


def write_in_order(results: Iterator[tuple[int, dict]], out: TextIO,
                   tally: Tally | None = None) -> tuple[int, int]:
    """Write records in input order as soon as each one and all before it are done (flushed
    line by line, so an interrupted run keeps every line written) -> (written, failed), also
    kept in ``tally`` as they change (what an interrupted run had written)."""
    done: dict[int, dict] = {}
    tally = Tally() if tally is None else tally
    for i, rec in results:
        done[i] = rec
        while tally.written in done:
            r = done.pop(tally.written)
            out.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")
            out.flush()
            tally.written += 1
            tally.failed += "error" in r
    return tally.written, tally.failed


def open_output(output: Path | None) -> TextIO:
    """stdout, or the --output file opened now: a bad path fails before the model loads."""
    if output is None:
        return sys.stdout
    try:
        return output.open("w", encoding="utf-8")
    except OSError as e:
        raise CliError(f"--output {output}: {e.strerror or e}", 2) from None


@model_options()
def generate(
    options: ModelOptions,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", help="A prompt (plain text); repeat for more (default: none).",
        show_default=False)
    ] = None,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", help="Prompts file: plain text lines or JSON objects, one a line "
        "('-': stdin) (default: stdin unless --prompt is given).",
        show_default=False)] = None,
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the JSONL here (default: stdout).", show_default=False)
    ] = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    presence_penalty: PresenceOpt = None,
    frequency_penalty: FrequencyOpt = None,
    repetition_penalty: RepetitionOpt = None,
    seed: SeedOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1,
                                            help="Most tokens per prompt.")] = 256,
    stop: StopOpt = None,
    chat: Annotated[bool, typer.Option(
        "--chat/--no-chat", help="Send each --prompt text and plain-text line as a user "
        "message through the model's chat template (JSON lines choose with 'messages' or "
        "'prompt').")] = False,
    think: ThinkOpt = None,
    progress: Annotated[bool, typer.Option("--progress/--no-progress",
                                           help="Progress bar on stderr.")] = True,
) -> None:
    """Generate for many prompts in one batch; writes one JSON line per prompt, in order.

    Input: the --prompt texts, then the non-blank lines of --input (or stdin), each plain
    text or a JSON object such as {"prompt": "...", "max_tokens": 32} or {"messages": [...],
    "chat_template_kwargs": {"enable_thinking": false}}, with any sampling field. Output, in
    input order as each is done: {"id", "prompt", "text", "token_ids", "finish_reason",
    "metrics"} (with thinking on, "reasoning_text" holds the think block and "text" the
    answer) or {"id", "error": "line N: ..."}. A prompt without an "id" gets its 0-based
    position in the output.

    Exit status: 0 when every prompt succeeded; 1 when any failed (each failed prompt still
    has its {"id", "error"} line, and the others their results), the model cannot be found
    or the run failed; 2 for a usage error (bad option or value, no prompts, an empty
    --prompt), reported before the model loads; 130 when interrupted (Ctrl-C): every line
    finished by then is written.
    """

    options = options.checked()
    flags = sampling_overrides(max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               min_p=min_p, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty,
                               repetition_penalty=repetition_penalty, seed=seed,
                               stop=stop or None)
    for i, text in enumerate(prompt or [], 1):
        if text == "":
            raise CliError(f"--prompt {i} is empty", 2)
    out = open_output(output)
    tally = Tally()
    try:
        items = read_items(prompt or [], input_file)
        if not items:
            raise CliError("no prompts in the input", 2)
        if chat:
            as_chat(items)
        llm = load_llm(options)
        defaults = {**sampling_defaults(llm.model_path), **flags, "max_tokens": max_tokens}
        results = run_items(llm, items, defaults, template_kwargs(think), progress, None)
        written, failed = write_in_order(results, out, tally)
    except KeyboardInterrupt:
        n = tally.written
        typer.echo(f"\ninterrupted: wrote {n} line{'' if n == 1 else 's'}", err=True)
        raise typer.Exit(130) from None
    finally:
        if out is not sys.stdout:
            out.close()
    if failed:
        typer.echo(f"{failed} of {written} prompts failed (see their error lines)", err=True)
        raise typer.Exit(1)
