"""``hybridrt trace``: run prompts (``generate``'s inputs) and show, step by step and request by
request, the five variables the engine carries (hybridrt.trace, docs/five-variables.md): the
hidden states' token ids and packed layout, the positions, the attention constraint (rows,
block table, causal range), the caches (KV blocks, prefix-cache hit, GDN state slots) and the
decoding (logits rows, sampling, tokens, drafts, finish). Then checks the trace's invariants.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

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
from hybridrt.cli.generate import as_chat, read_items, run_items
from hybridrt.cli.options import ModelOptions, model_options


def parse_steps(text: str) -> tuple[tuple[int, int | None], ...]:
    """'0-3,7,10-' -> ((0, 3), (7, 7), (10, None)); CliError (exit 2) when malformed."""
    out = []
    for part in text.split(","):
        a, dash, b = part.strip().partition("-")
        try:
            lo = int(a)
            hi = (int(b) if b else None) if dash else lo
        except ValueError:
            raise CliError(f"--steps: {part.strip()!r} is not a step, a range A-B or A-",
                           2) from None
        if lo < 0 or (hi is not None and hi < lo):
            raise CliError(f"--steps: {part.strip()!r} is not a range of steps (0 is the "
                           f"first)", 2)
        out.append((lo, hi))
    return tuple(out)


def _wanted(step: int, ranges) -> bool:
    return not ranges or any(lo <= step and (hi is None or step <= hi) for lo, hi in ranges)


def _check_filters(steps: list[dict], ranges, wanted: set[str] | None) -> None:
    """A --steps or --request that matched nothing in the run -> CliError (exit 2)."""
    if ranges and not any(_wanted(r["step"], ranges) for r in steps):
        raise CliError(f"--steps: the run had {len(steps)} steps (0-{len(steps) - 1}), none "
                       f"of them in the range given", 2)
    seen = {s["request"] for r in steps for s in r["seqs"]}
    missing = sorted(wanted - seen) if wanted else []
    if missing:
        raise CliError(f"--request: no request {', '.join(missing)} in the run (its requests: "
                       f"{', '.join(sorted(seen, key=lambda x: (len(x), x)))})", 2)


def _open(path: Path | None, flag: str):
    if path is None or str(path) == "-":
        return None
    try:
        return path.open("w", encoding="utf-8")
    except OSError as e:
        raise CliError(f"{flag} {path}: {e.strerror or e}", 2) from None


@model_options()
def trace(
    options: ModelOptions,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", "-p", help="A prompt (plain text); repeat for more (default: none).",
        show_default=False)] = None,
    input_file: Annotated[Path | None, typer.Option(
        "--input", "-i", help="Prompts file, as generate reads it ('-': stdin) (default: stdin "
        "unless --prompt is given).", show_default=False)] = None,
    chat: Annotated[bool, typer.Option(
        "--chat/--no-chat", help="Send each plain-text prompt as a user message through the "
        "chat template.")] = False,
    think: ThinkOpt = None,
    temperature: TemperatureOpt = None,
    top_p: TopPOpt = None,
    top_k: TopKOpt = None,
    min_p: MinPOpt = None,
    presence_penalty: PresenceOpt = None,
    frequency_penalty: FrequencyOpt = None,
    repetition_penalty: RepetitionOpt = None,
    seed: SeedOpt = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1,
                                            help="Most tokens per prompt.")] = 8,
    stop: StopOpt = None,
    steps: Annotated[str | None, typer.Option(
        "--steps", help="Show these steps only: 3, 0-4, 10- or a comma list (default: all).",
        show_default=False)] = None,
    request: Annotated[list[str] | None, typer.Option(
        "--request", "-r", help="Show this request only (its engine id, as the table shows "
        "it: 0 is the first prompt that runs); repeat for more (default: all).",
        show_default=False)] = None,
    jsonl: Annotated[Path | None, typer.Option(
        "--jsonl", help="Write the trace as JSON lines (a header, then one line per step) "
        "('-': stdout, instead of the table) (default: none).", show_default=False)] = None,
    html_file: Annotated[Path | None, typer.Option(
        "--html", help="Write one self-contained HTML page: the steps as a timeline (default: "
        "none).",
        show_default=False)] = None,
    times: Annotated[bool, typer.Option(
        "--times/--no-times", help="Each step's phases' durations in the table.")] = True,
    check: Annotated[bool, typer.Option(
        "--check/--no-check", help="Check the trace's invariants (positions, isolation, "
        "prefix hits, draft rollback); a violation fails the command.")] = True,
) -> None:
    """Trace the engine's steps for some prompts: per step and per request, the five
    variables (hidden states, positions, attention constraint, caches, decoding).

    Exit status: 0 when every prompt ran and (with --check) every invariant held; 1 when a
    prompt failed or an invariant broke (each on its own line on stderr); 2 for a usage error.
    """
    from hybridrt.trace import TraceRecorder, check_trace
    from hybridrt.trace.render_html import render_html
    from hybridrt.trace.render_text import header_lines, step_lines

    options = options.checked()
    ranges = parse_steps(steps) if steps is not None else ()
    flags = sampling_overrides(max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               min_p=min_p, presence_penalty=presence_penalty,
                               frequency_penalty=frequency_penalty,
                               repetition_penalty=repetition_penalty, seed=seed,
                               stop=stop or None)
    items = read_items(prompt or [], input_file)
    if not items:
        raise CliError("no prompts in the input", 2)
    if chat:
        as_chat(items)
    to_stdout = jsonl is not None and str(jsonl) == "-"
    jsonl_out = _open(jsonl, "--jsonl")
    if html_file is not None:
        _open(html_file, "--html").close()  # a bad path fails before the model loads
    wanted = set(request) if request else None
    llm = load_llm(options)
    rec = TraceRecorder.attach(llm.engine)
    header = rec.header()
    json_out = sys.stdout if to_stdout else jsonl_out
    if json_out is not None:
        json_out.write(json.dumps(header) + "\n")
    if not to_stdout:
        typer.echo("\n".join(header_lines(header)))

    def show(record: dict) -> None:
        if json_out is not None:
            json_out.write(json.dumps(record) + "\n")
        if to_stdout or not _wanted(record["step"], ranges) or (
                wanted is not None and not wanted & {s["request"] for s in record["seqs"]}):
            return
        typer.echo("\n" + "\n".join(step_lines(record, wanted, times)))

    rec.sink = show
    defaults = {**sampling_defaults(llm.model_path), **flags, "max_tokens": max_tokens}
    failed = 0
    try:
        results = list(run_items(llm, items, defaults, template_kwargs(think), False, None))
    finally:
        if jsonl_out is not None:
            jsonl_out.close()
    for _, result in sorted(results, key=lambda r: r[0]):
        if "error" in result:
            failed += 1
            typer.echo(f"error: prompt {result['id']}: {result['error']}", err=True)
        elif not to_stdout:
            typer.echo(f"\nprompt {result['id']}: {json.dumps(result['text'])} "
                       f"({result['finish_reason']})")
    if html_file is not None:
        html_file.write_text(render_html(header, rec.steps, f"hybridrt trace: "
                                         f"{llm.model_path}"), encoding="utf-8")
    _check_filters(rec.steps, ranges, wanted)
    broken = check_trace(rec.steps) if check else []
    for v in broken:
        typer.echo(f"invariant broken: {v}", err=True)
    if check and not broken:
        typer.echo(f"invariants: positions, isolation, prefix_hit, draft_rollback hold over "
                   f"{len(rec.steps)} steps", err=True)
    if failed or broken:
        raise typer.Exit(1)
