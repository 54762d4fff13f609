"""``hybridrt bench``: the commands over ``hybridrt.bench``; each prints a table and, with
``--json``, writes the report (``throughput`` and ``spec`` also draw a chart with ``--plot``).
Those that load a model take the whole model option group (cli/options.py). The benchmark
modules are imported inside the commands, so that ``hybridrt chat`` never loads them
(tests/test_bench_layout.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Annotated

import typer

from hybridrt.cli.common import CliError
from hybridrt.cli.options import ModelOptions, ThreadsOpt, model_options

bench_app = typer.Typer(no_args_is_help=True, add_completion=False, rich_markup_mode=None,
                        help="Benchmarks: throughput vs llama.cpp and transformers, speculative "
                             "decoding, the CPU GEMM paths, start-up, int8 and int4 quality, the "
                             "server, preemption. Each prints a table; --json FILE writes its "
                             "report, --plot PNG (throughput, spec) a chart. llamacpp-build "
                             "builds llama.cpp and llamacpp-convert a GGUF for throughput "
                             "--against-llamacpp.")

PlotOpt = Annotated[Path | None, typer.Option(
    "--plot", help="Also draw a chart to this PNG (needs matplotlib, the 'plot' extra) "
    "(default: no chart).",
    show_default=False)]


def has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _need_matplotlib(plot: Path | None) -> None:
    if plot is not None and not has_matplotlib():
        raise CliError("--plot needs matplotlib, which is not installed "
                       "(pip install 'hybridrt[plot]')", 2)


JsonOpt = Annotated[str | None, typer.Option(
    "--json", help="Also write the report to this JSON file (default: none).",
    show_default=False)]


def _default_threads() -> int:
    """chat's and generate's default: torch's own (the number of physical cores)."""
    import torch

    return torch.get_num_threads()


def _int_list(name: str, text: str, minimum: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise CliError(f"{name} must be comma-separated integers, got {text!r}", 2) from None
    if not values or any(v < minimum for v in values):
        raise CliError(f"{name} needs integers >= {minimum}, got {text!r}", 2)
    return values


WEIGHT_FORMATS = ("bf16", "int8", "int4")
KV_DTYPES = ("bf16", "int8")


def _choice(flag: str, value: str, allowed: tuple[str, ...], what: str) -> str:
    """``value`` if one of ``allowed``; else the flag's one-line usage error."""
    if value not in allowed:
        raise CliError(f"{flag}: unknown {what} {value!r}; choose {', '.join(allowed[:-1])} or "
                       f"{allowed[-1]}", 2)
    return value


def _choices(flag: str, text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """A comma-separated ``text`` whose every item is one of ``allowed`` (``_choice``)."""
    return [_choice(flag, v.strip(), allowed, what) for v in text.split(",") if v.strip()]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# throughput ----------------------------------------------------------------------------------
_SPEC = "hybridrt bench spec measures speculative decoding"
THROUGHPUT_SETS = {
    "max_model_len": "--prefill-len, --prompt-len and --decode-tokens set the context",
    "max_num_seqs": "the largest --concurrency",
    "max_num_batched_tokens": "max(--prefill-len, 512)",
    "cache_memory": "the cache is sized to the workload, as llama.cpp's -c",
    "block_size": "the cache is sized for 16-token blocks",
    "max_num_sessions": "no session slots (0)",
    "device": "a CPU benchmark beside transformers and llama.cpp on the CPU",
    "speculative_tokens": _SPEC,
    "draft_vocab_size": _SPEC,
}


@bench_app.command("throughput")
@model_options(dtype="bfloat16", refuse=THROUGHPUT_SETS, model_help=(
    "Checkpoint dir or hub id (default: a random-weight Qwen3.5-0.8B-shaped checkpoint)."))
def throughput(
    options: ModelOptions,
    prefill_len: Annotated[int, typer.Option(
        "--prefill-len", min=1, help="Prompt length of the prefill measurement.")] = 512,
    prompt_len: Annotated[int, typer.Option(
        "--prompt-len", min=1, help="Prompt length of the decode measurements.")] = 16,
    decode_tokens: Annotated[int, typer.Option(
        "--decode-tokens", min=2, help="New tokens per request when decoding.")] = 16,
    concurrency: Annotated[str, typer.Option("--concurrency",
                                             help="Comma-separated batch sizes.")] = "8,32",
    repeats: Annotated[int | None, typer.Option(
        "--repeats", min=1, help="Runs per measurement, the median reported (default: 1; "
        "with --full 2).", show_default=False)] = None,
    transformers: Annotated[bool | None, typer.Option(
        "--transformers/--no-transformers", help="Also run transformers generate on the same "
        "weights (default: only with --full).", show_default=False)] = None,
    full: Annotated[bool, typer.Option(
        "--full", help="The long run (several minutes on 2 cores): 2 repeats, transformers "
        "side by side, and the batching ratio again from batch 1 and the largest batch "
        "alternated three times (default: off, a short run).")] = False,
    against_llamacpp: Annotated[list[Path] | None, typer.Option(
        "--against-llamacpp", metavar="GGUF", help="Also run llama.cpp's llama-bench and "
        "llama-batched-bench on this GGUF of the same model, same work and threads, and add "
        "its columns and our ratios to it; repeat for more GGUFs (e.g. Q4_K_M and Q4_0), each "
        "run in every llama.cpp round (default: off).", show_default=False)] = None,
    llamacpp_bin: Annotated[Path | None, typer.Option(
        "--llamacpp-bin", metavar="DIR", help="Folder of llama-bench and llama-batched-bench "
        "(default: $LLAMACPP_HOME/llama.cpp/build/bin, LLAMACPP_HOME defaulting to "
        "~/.cache/hybridrt-llamacpp).", show_default=False)] = None,
    order: Annotated[str, typer.Option(
        "--order", help="With --against-llamacpp: the rounds, alternated so that a change in "
        "the machine's load reaches both engines; medians per engine.")
    ] = "hybridrt,llamacpp,hybridrt,llamacpp",
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Prefill, batch-1 decode and aggregate tok/s, side by side with llama.cpp
    (--against-llamacpp) and transformers (--full or --transformers); the machine's read
    bandwidth and the batch-1 ceiling. By default a short run; --full the long one. With
    --quantization, transformers (which runs the unquantized weights) is left out."""
    _need_matplotlib(plot)
    options = options.checked()
    if options.dtype == "auto":
        raise CliError("--dtype auto: name the dtype (transformers runs the same one)", 2)
    sizes = _int_list("--concurrency", concurrency, 1)
    from hybridrt.bench import llamacpp

    rounds = [e.strip() for e in order.split(",") if e.strip()]
    try:
        llamacpp.check_order(rounds)
        for gguf in against_llamacpp or []:
            llamacpp.check(gguf, llamacpp_bin)
    except (ValueError, llamacpp.LlamaCppError) as e:
        raise CliError(str(e), 2) from None
    from hybridrt.bench import throughput as bench

    report = bench.throughput(
        model=options.model, dtype=options.dtype, threads=options.threads or _default_threads(),
        prefill_len=prefill_len, prompt_len=prompt_len, decode_tokens=decode_tokens,
        concurrency=sizes, repeats=repeats or (2 if full else 1),
        transformers=full if transformers is None else transformers, interleave=full,
        json_path=json_path, against_llamacpp=against_llamacpp, llamacpp_bin=llamacpp_bin,
        order=rounds, quantization=options.quantization,
        batch_invariant=options.batch_invariant,
        engine=options.llm_kwargs(*THROUGHPUT_SETS, "dtype", "threads", "quantization",
                                  "batch_invariant"),
    )
    if plot is not None:
        plot_throughput(report, plot)
        typer.echo(f"wrote {plot}", err=True)


@bench_app.command("gemm")
def gemm(
    rows: Annotated[str, typer.Option("--rows", help="Comma-separated row counts.")
                    ] = "1,2,8,32,512",
    threads: Annotated[int, typer.Option("--threads", min=1, help="CPU threads.")] = 2,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, help="Interleaved rounds per path (the median is reported).")] = 9,
    json_path: JsonOpt = None,
) -> None:
    """ms per weight of the CPU half-weight GEMM paths at the 0.8B shapes (kernels/linear.py),
    and of the int8 kernels (kernels/quant.py)."""
    from hybridrt.bench import gemm as bench

    rows_report = bench.gemm(_int_list("--rows", rows, 1), threads=threads, rounds=rounds)
    if json_path is not None:
        Path(json_path).write_text(json.dumps({"threads": threads, "rounds": rounds,
                                               "rows": rows_report}, indent=2) + "\n")
        typer.echo(f"wrote {json_path}", err=True)


@bench_app.command("gemv")
def gemv(
    rows: Annotated[str, typer.Option("--rows", help="Comma-separated row counts (1-8).")
                    ] = "1,2,3,4,8",
    threads: Annotated[int, typer.Option("--threads", min=1, help="CPU threads.")] = 2,
    repeats: Annotated[int, typer.Option(
        "--repeats", min=1, help="Rounds, alternating every path, row count and the read loop "
        "(the median is reported).")] = 5,
    paths: Annotated[str | None, typer.Option(
        "--paths", help="Comma-separated kernel paths among bf16dot, fma, int8-vnni, int8-avx2, "
        "int4-vnni, int4-avxvnni, int4-avx2 (default: every one built here).",
        show_default=False)] = None,
    cpu_time: Annotated[bool, typer.Option(
        "--cpu-time", help="Time in this process's CPU seconds instead of wall seconds: with "
        "--threads 1, the speed on a core of its own (default: off).")] = False,
    json_path: JsonOpt = None,
) -> None:
    """One decode step's products at the 0.8B shape per kernel path and row count, against the
    read loop over the same weights and each path's dot-product peak, measured in the same run.
    """
    from hybridrt.bench.gemv import PATHS, run_gemv_bench

    path_list = None
    if paths is not None:
        path_list = [p.strip() for p in paths.split(",") if p.strip()]
        bad = [p for p in path_list if p not in PATHS]
        if bad or not path_list:
            raise CliError(f"--paths: unknown path(s) {', '.join(bad) or repr(paths)}; choose "
                           f"among {', '.join(PATHS)}", 2)
    row_list = _int_list("--rows", rows, 1)
    if max(row_list) > 8:
        raise CliError(f"--rows: at most 8 rows (the GEMV's), got {max(row_list)}", 2)
    try:
        run_gemv_bench(row_list, threads=threads, repeats=repeats, paths=path_list,
                       json_path=json_path, cpu_time=cpu_time)
    except (ValueError, RuntimeError) as e:
        raise CliError(str(e), 2) from e


def plot_throughput(report: dict, path: Path) -> None:
    plt = _pyplot()
    engines = [(label, report[key]) for key, label in (
        ("hybridrt", "hybridrt"), ("llamacpp", "llama.cpp"), ("transformers", "transformers"))
        if key in report]
    names = list(report["hybridrt"])
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(names)), 4))
    width = 0.8 / len(engines)
    for j, (label, rows) in enumerate(engines):
        ax.bar([i + (j - (len(engines) - 1) / 2) * width for i in range(len(names))],
               [rows.get(n, 0.0) for n in names], width, label=label)
    ax.set_xticks(range(len(names)), [n.replace("_tok_s", "") for n in names])
    ax.set_ylabel("tokens / s")
    ax.set_title(f"throughput: {report.get('model')} ({report.get('dtype')}, "
                 f"{report.get('threads')} threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# spec ----------------------------------------------------------------------------------------
SPEC_SETS = {
    "speculative_tokens": "--ks sets the draft lengths",
    "draft_vocab_size": "--draft-vocabs sets the draft heads",
    "enable_prefix_caching": "every run starts cold",
    "max_num_seqs": "the largest --batch-sizes",
    "max_model_len": "the model's, at most 4096",
}


@bench_app.command("spec")
@model_options(dtype="float32", refuse=SPEC_SETS)
def spec(
    options: ModelOptions,
    ks: Annotated[str, typer.Option("--ks", help="Draft lengths to compare (0 = no "
                                                 "speculation, the baseline).")] = "0,1,2,3,4",
    batch_sizes: Annotated[str, typer.Option(
        "--batch-sizes", help="Comma-separated numbers of concurrent requests.")] = "1,8",
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, help="New tokens per request.")] = 64,
    prompt: Annotated[list[str] | None, typer.Option(
        "--prompt", help="A prompt; repeat for more (default: the benchmark's chat questions).",
        show_default=False)] = None,
    prompts_file: Annotated[Path | None, typer.Option(
        "--prompts", help="Prompts file, one per line (default: none).", show_default=False)
    ] = None,
    temperature: Annotated[float, typer.Option(
        "--temperature", min=0.0, help="0 (greedy) also checks every k reproduces k=0.")] = 0.0,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos", help="Always generate --max-tokens tokens (default: off).")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="A short smoke run (default: off).")
                     ] = False,
    num_prompts: Annotated[int, typer.Option(
        "--num-prompts", min=1, help="How many of the default prompts to run.")] = 8,
    repeats: Annotated[int, typer.Option(
        "--repeats", min=1, help="Runs of every row, alternated (the median tok/s is "
        "reported).")] = 1,
    cpu_time: Annotated[bool, typer.Option(
        "--cpu-time", help="Time in this process's CPU seconds instead of wall seconds: with "
        "--threads 1, the speed on a machine of its own (default: off).")] = False,
    draft_vocabs: Annotated[str, typer.Option(
        "--draft-vocabs", help="Comma-separated draft-head sizes to compare: N drafts from the "
        "N most frequent tokens (the model's draft_vocab.json, else the first N ids), 0 from "
        "the full head.")] = "0",
    simulate_acceptance: Annotated[str | None, typer.Option(
        "--simulate-acceptance", help="Comma-separated acceptance rates in [0, 1]: the MTP "
        "drafts at its real cost, then each draft is replaced by the target's own greedy token "
        "with that probability, a wrong one otherwise; rows are labelled simulated (default: "
        "off, the real acceptance).", show_default=False)] = None,
    probe_acceptance: Annotated[float, typer.Option(
        "--probe-acceptance", min=0.0, max=1.0, help="With --simulate-acceptance: a draft "
        "through adaptive k's probe head (one-draft rounds, a large vocabulary's) is right with "
        "this fraction of the rate.")] = 1.0,
    workload: Annotated[str, typer.Option(
        "--workload", help="questions (generic chat questions) or copy (outputs that repeat "
        "their prompts: a file rewritten; where --speculative-method ngram pays).")
    ] = "questions",
    context: Annotated[int, typer.Option(
        "--context", min=0, help="Tokens of a shared context before every prompt (cached once): "
        "decoding deep in a context.")] = 0,
    json_path: JsonOpt = None,
    plot: PlotOpt = None,
) -> None:
    """Speculative decoding per k and batch size (drafts from the MTP head, or prompt lookup
    with --speculative-method ngram / mtp+ngram; --speculative-adaptive: k up to each row's).

    Reports tok/s, speedup over k=0, mean acceptance length and per-position acceptance, and
    the measured cost of a draft pass and of a verify step against a k=0 decode step, with the
    acceptance rate at which k drafts break even.
    """
    _need_matplotlib(plot)
    options = options.checked()
    k_list = _int_list("--ks", ks, 0)
    b_list = _int_list("--batch-sizes", batch_sizes, 1)
    dv_list = _int_list("--draft-vocabs", draft_vocabs, 0)
    alphas = None
    if simulate_acceptance is not None:
        try:
            alphas = [float(a) for a in simulate_acceptance.split(",") if a.strip()]
        except ValueError:
            alphas = []
        if not alphas or not all(0.0 <= a <= 1.0 for a in alphas):
            raise CliError(f"--simulate-acceptance needs comma-separated rates in [0, 1], got "
                           f"{simulate_acceptance!r}", 2)
        if temperature != 0.0:
            raise CliError("--simulate-acceptance replays the greedy continuation: it needs "
                           "--temperature 0", 2)
        if 0 not in k_list:
            raise CliError("--simulate-acceptance needs k=0 in --ks (its reference run)", 2)
    if workload not in ("questions", "copy"):
        raise CliError(f"--workload must be questions or copy, got {workload!r}", 2)
    prompts = list(prompt or [])
    if prompts_file is not None:
        try:
            prompts += [p for p in prompts_file.read_text().splitlines() if p.strip()]
        except OSError as e:
            raise CliError(f"--prompts {prompts_file}: {e.strerror or e}") from None
        if not prompts:
            raise CliError(f"--prompts {prompts_file} has no prompts", 2)
    from hybridrt.bench.spec import run_spec_bench
    from hybridrt.llm import default_model

    model = options.model
    report = run_spec_bench(default_model() if model is None else model, ks=tuple(k_list),
                            batch_sizes=tuple(b_list), prompts=prompts or None,
                            max_tokens=max_tokens, dtype=options.dtype,
                            threads=options.threads or _default_threads(),
                            json_path=json_path, quick=quick, temperature=temperature,
                            ignore_eos=ignore_eos, draft_vocabs=tuple(dv_list),
                            simulate_acceptance=alphas, num_prompts=num_prompts,
                            repeats=repeats, cpu_time=cpu_time,
                            quantization=options.quantization,
                            engine=options.llm_kwargs(*SPEC_SETS, "dtype", "threads",
                                                      "quantization"),
                            workload=workload, context=context,
                            probe_acceptance=probe_acceptance)
    if plot is not None:
        plot_spec(report, plot)
        typer.echo(f"wrote {plot}", err=True)


def plot_spec(report: dict, path: Path) -> None:
    plt = _pyplot()
    rows = report["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    lines: dict[tuple, list[dict]] = {}  # one line per (batch, draft head, alpha), from k = 0
    for r in rows:
        if r["k"] > 0:
            lines.setdefault((r["batch_size"], r.get("draft_vocab"), r.get("simulated_alpha")),
                             []).append(r)
    for (b, dv, alpha), sel in lines.items():
        base = [r for r in rows if r["batch_size"] == b and r["k"] == 0]
        sel = sorted(base + sel, key=lambda r: r["k"])
        label = f"batch {b}" + (f", head {dv}" if dv else "") + (
            f", simulated alpha {alpha}" if alpha is not None else "")
        ax1.plot([r["k"] for r in sel], [r["tok_s"] for r in sel], marker="o", label=label)
        acc = [(r["k"], r["mean_acceptance_length"]) for r in sel if r["k"] > 0]
        ax2.plot([k for k, _ in acc], [a or 0 for _, a in acc], marker="o", label=label)
    ax1.set_xlabel("draft tokens k")
    ax1.set_ylabel("output tokens / s")
    ax1.set_title("throughput")
    ax2.set_xlabel("draft tokens k")
    ax2.set_ylabel("mean acceptance length")
    ax2.set_title("acceptance" + (" (simulated)" if report.get("acceptance") == "simulated"
                                  else ""))
    for ax in (ax1, ax2):
        ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    fig.suptitle(f"speculative decoding: {report.get('model', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# quality -------------------------------------------------------------------------------------
@bench_app.command("quality")
def quality(
    model_08b: Annotated[str | None, typer.Option(
        "--model-08b", help="A Qwen3.5-0.8B-shaped checkpoint for the logits comparison "
        "(default: random bf16 weights written to a temporary directory).",
        show_default=False)] = None,
    skip_08b: Annotated[bool, typer.Option(
        "--skip-08b", help="Only the demo model (default: off).")] = False,
    max_docs: Annotated[int | None, typer.Option(
        "--max-docs", min=1, help="Score only the first N held-out documents (default: all).",
        show_default=False)] = None,
    against_llamacpp: Annotated[list[Path] | None, typer.Option(
        "--against-llamacpp", metavar="GGUF", help="A GGUF of the demo model (repeat: its bf16 "
        "and quantized ones, e.g. Q4_K_M, Q4_0): the held-out text scored as llama-perplexity "
        "scores it, by llama.cpp on each and by our model holding each one's tensors (needs "
        "the gguf package) (default: off).", show_default=False)] = None,
    llamacpp_bin: Annotated[Path | None, typer.Option(
        "--llamacpp-bin", metavar="DIR", help="Folder of llama-perplexity (default: as bench "
        "throughput's).", show_default=False)] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="A trained checkpoint with the demo's tokenizer in the demo model's "
        "place, e.g. an MoE from scripts/demo/train.py --experts (default: the demo model).",
        show_default=False)] = None,
    mixed: Annotated[list[str] | None, typer.Option(
        "--mixed", metavar="PARTS", help="One more model: int4 with the weights whose names "
        "hold one of these comma-separated parts at 8 bits, as hybridrt quantize --int8 "
        "writes it (repeat for more; default: none).", show_default=False)] = None,
    threads: ThreadsOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """int8 and int4 against bf16 weights: perplexity and greedy agreement of the demo model on
    held-out text (and against llama.cpp's formats with --against-llamacpp); logits error and
    top-1 agreement at the 0.8B shape (random weights)."""
    for gguf in against_llamacpp or []:
        if not gguf.is_file():
            raise CliError(f"--against-llamacpp: no GGUF file at {gguf}", 2)
    from hybridrt.cli.common import int8_parts, resolve_model

    parts = tuple(int8_parts("--mixed", m) for m in mixed or [])
    if model is not None:
        model = resolve_model(model)
    from hybridrt.bench.quality import run_quality
    from hybridrt.loader import Int8PartsError

    try:
        run_quality(model_08b, skip_08b=skip_08b, threads=threads or _default_threads(),
                    max_docs=max_docs, json_path=json_path, llamacpp_ggufs=against_llamacpp,
                    llamacpp_bin=llamacpp_bin, model=model, mixed=parts)
    except Int8PartsError as e:  # a part that names no weight
        raise CliError(f"--mixed: {e}", 2) from None


# startup --------------------------------------------------------------------------------------
@bench_app.command("startup")
@model_options()
def startup(
    options: ModelOptions,
    runs: Annotated[int, typer.Option(
        "--runs", min=1, help="Runs of each measurement, alternated (the median is "
        "reported).")] = 5,
    json_path: JsonOpt = None,
    against_llamacpp: Annotated[Path | None, typer.Option(
        "--against-llamacpp", metavar="GGUF", help="Also time llama.cpp's start-up to its "
        "first token on this GGUF (llama-bench -p 2 -n 0), alternated (default: off).",
        show_default=False)] = None,
    llamacpp_bin: Annotated[Path | None, typer.Option(
        "--llamacpp-bin", metavar="DIR", help="Folder of llama-bench (default: as bench "
        "throughput).", show_default=False)] = None,
) -> None:
    """Start-up: hybridrt generate -p hi --max-tokens 1 against python -c 'import torch'.

    Each figure comes from a fresh interpreter; the one that matters is the load and first
    token beyond importing torch (target 1.5 s on the demo model). On a GGUF MODEL,
    --against-llamacpp SAME.gguf times llama.cpp starting on the same file.
    """
    from hybridrt.bench.llamacpp import LlamaCppError
    from hybridrt.bench.startup import run_startup_bench

    options = options.checked()
    try:
        run_startup_bench(options.model, runs=runs, threads=options.threads, json_path=json_path,
                          engine=options.llm_kwargs("threads"),
                          engine_flags=options.flags("threads"),
                          against_llamacpp=against_llamacpp, llamacpp_bin=llamacpp_bin)
    except LlamaCppError as e:
        raise CliError(str(e), 2) from None


@bench_app.command("gguf-error")
def gguf_error(
    files: Annotated[list[Path], typer.Argument(
        metavar="FILE.gguf...", help="GGUF files (qwen35).", show_default=False)],
    json_path: JsonOpt = None,
) -> None:
    """Per GGUF type, every weight as hybridrt loads it against gguf's numpy dequantization:
    tensors, max and mean relative RMS error, bit-exact ones (hybridrt.bench.gguf_error)."""
    from hybridrt.bench.gguf_error import run_gguf_error_bench
    from hybridrt.gguf.reader import GGUFError

    for f in files:
        if not f.is_file():
            raise CliError(f"no GGUF file at {f}", 2)
    try:
        run_gguf_error_bench(files, json_path=json_path)
    except GGUFError as e:
        raise CliError(str(e)) from None


# busy ----------------------------------------------------------------------------------------
BUSY_SETS = {
    "threads": "each variant sets it (the default's, then every explicit count)",
    "max_num_seqs": "one sequence",
    "max_model_len": "64 tokens",
    "cache_memory": "64MiB",
}


@bench_app.command("busy")
@model_options(refuse=BUSY_SETS)
def busy(
    options: ModelOptions,
    tokens: Annotated[int, typer.Option(
        "--tokens", min=2, help="New tokens per decode run.")] = 64,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, help="Runs of each variant, alternated (the median is "
        "reported).")] = 2,
    json_path: JsonOpt = None,
) -> None:
    """Batch-1 decode with the default threads against each explicit --threads, on the
    machine as it is and beside one busy process (each run a fresh interpreter)."""
    from hybridrt.bench.busy import run_busy_bench

    options = options.checked()
    run_busy_bench(options.model, tokens=tokens, rounds=rounds, json_path=json_path,
                   engine=options.llm_kwargs(*BUSY_SETS))


# serve ---------------------------------------------------------------------------------------
SERVE_SETS = {
    "enable_prefix_caching": "it runs with prefix caching on, then off",
    "max_num_seqs": "--conversations sets it",
}


@bench_app.command("serve")
@model_options(refuse=SERVE_SETS)
def bench_serve(
    options: ModelOptions,
    conversations: Annotated[int, typer.Option(
        "--conversations", min=1, help="Concurrent clients, one conversation each.")] = 8,
    turns: Annotated[int, typer.Option("--turns", min=1, help="Turns per conversation.")] = 4,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, help="Tokens generated per turn (EOS ignored).")] = 32,
    time_limit: Annotated[float, typer.Option(
        "--time-limit", min=1, help="Seconds per run; turns not started by then are "
        "skipped and reported.")] = 300.0,
    json_path: JsonOpt = None,
    replicas: Annotated[str | None, typer.Option(
        "--replicas", help="Replica counts to compare on Ray Serve, e.g. 1,2: a run per count "
        "(prefix-aware routing) and, beyond one, one with Ray Serve's power-of-two router "
        "(default: one engine, prefix caching on and off).", show_default=False)] = None,
    router_imbalance: Annotated[int | None, typer.Option(
        "--router-imbalance", min=0, help="With --replicas: hybridrt serve's "
        "--router-imbalance (default: its default).", show_default=False)] = None,
) -> None:
    """Loopback load test of `hybridrt serve`: multi-turn chat clients streaming at once,
    with and without prefix reuse (or over Ray Serve replicas and routers): requests/s, TTFT
    and inter-token latency percentiles, prefix hit rate."""
    from hybridrt.cli.serve import _check_deps

    _check_deps("hybridrt bench serve")
    options = options.checked()
    counts = None
    if replicas is not None:
        counts = _int_list("--replicas", replicas, 1)
        try:
            import ray  # noqa: F401
        except ImportError:
            raise CliError("hybridrt bench serve --replicas needs Ray Serve: pip install "
                           "'hybridrt[ray]'", 2) from None
    from hybridrt.bench import serve as servebench

    servebench.run(model=options.model, conversations=conversations, turns=turns,
                   max_tokens=max_tokens, time_limit=time_limit, threads=options.threads,
                   json_path=json_path, replicas=counts, router_imbalance=router_imbalance,
                   engine_flags=options.flags(*SERVE_SETS, "threads"))


# prefix --------------------------------------------------------------------------------------
PREFIX_SETS = {
    "enable_prefix_caching": "it compares prefix caching on and off",
    "max_model_len": "sized to the workload",
    "max_num_seqs": "the largest of --requests, --disjoint-requests, --document-questions",
}


@bench_app.command("prefix")
@model_options(cache_memory="4GiB", refuse=PREFIX_SETS)
def prefix(
    options: ModelOptions,
    num_requests: Annotated[int, typer.Option(
        "--requests", min=1, help="Requests sharing the system prompt, submitted at once.")] = 32,
    system_tokens: Annotated[int, typer.Option(
        "--system-tokens", min=2, help="Tokens of the shared system message.")] = 2048,
    question_tokens: Annotated[int, typer.Option(
        "--question-tokens", min=2, help="Tokens of each request's own question.")] = 64,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, help="Tokens generated per request.")] = 16,
    disjoint_requests: Annotated[int, typer.Option(
        "--disjoint-requests", min=1, help="Requests of the workload that shares nothing.")] = 64,
    disjoint_tokens: Annotated[int, typer.Option(
        "--disjoint-tokens", min=1, help="Prompt tokens of each of them.")] = 128,
    document_tokens: Annotated[int, typer.Option(
        "--document-tokens", min=2, help="Tokens of the document workload's shared text.")
    ] = 3000,
    document_questions: Annotated[int, typer.Option(
        "--document-questions", min=1, help="Questions asked about it, submitted at once.")
    ] = 16,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Alternated rounds.")] = 2,
    workloads: Annotated[str, typer.Option(
        "--workloads", help="Comma-separated: shared, document, disjoint, restart (the disk "
        "tier: a conversation whose process is restarted midway).")
    ] = "shared,document,disjoint",
    cpu_time: Annotated[bool, typer.Option(
        "--cpu-time", help="Time the workloads in this process's CPU time (a busy machine; "
        "with --threads 1); TTFT stays wall time (default: off).")] = False,
    json_path: JsonOpt = None,
) -> None:
    """Prefix caching on, on with the policy before branch points, and off in one run:
    requests sharing a system prompt, questions about one document in one user message
    (prefilled tokens, time to first token) and requests sharing nothing (throughput).
    --cache-memory is the budget of each of the three engines. restart: a 6-turn
    conversation with the disk tier, its process restarted after turn 3 (and with its newest
    checkpoint file damaged), against one that never stops (batch-invariant mode)."""
    kinds = ("shared", "document", "disjoint", "restart")
    chosen = tuple(w.strip() for w in workloads.split(",") if w.strip())
    bad = [w for w in chosen if w not in kinds]
    if bad or not chosen:
        raise CliError(f"--workloads: unknown workload(s) {bad or chosen}; choose from "
                       f"{', '.join(kinds)}", 2)
    options = options.checked()
    from hybridrt.bench import prefix as prefixbench
    from hybridrt.cli.common import resolve_model

    model = resolve_model(options.model)
    own = ("threads", "dtype", "quantization", "cache_memory")
    engine = options.llm_kwargs(*PREFIX_SETS, *own)
    report = {}
    if "restart" in chosen:
        from hybridrt.bench import prefix_restart

        kw = {**engine, **{k: getattr(options, k) for k in own}, "max_model_len": 4096}
        for k in ("batch_invariant", "prefix_cache_dir", "prefix_cache_dir_size"):
            kw.pop(k, None)  # the workload sets them
        try:
            report["restart"] = prefix_restart.run(model, max_tokens=max_tokens, engine=kw)
        except ValueError as e:
            raise CliError(str(e), 2) from None
        chosen = tuple(w for w in chosen if w != "restart")
    if not chosen:
        if json_path is not None:
            Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
        return
    try:
        prefixbench.run(model, threads=options.threads,
                        dtype=options.dtype, quantization=options.quantization,
                        num_requests=num_requests, system_tokens=system_tokens,
                        question_tokens=question_tokens, max_tokens=max_tokens,
                        disjoint_requests=disjoint_requests, disjoint_tokens=disjoint_tokens,
                        document_tokens=document_tokens, document_questions=document_questions,
                        rounds=rounds, cache_memory=options.cache_memory, workloads=chosen,
                        json_path=json_path, cpu_time=cpu_time, engine=engine)
    except ValueError as e:
        raise CliError(str(e), 2) from None
    if report and json_path is not None:  # the restart workload's report beside the others
        Path(json_path).write_text(json.dumps(
            {**json.loads(Path(json_path).read_text()), **report}, indent=2) + "\n")


# preemption ----------------------------------------------------------------------------------
def _pair(name: str, text: str) -> tuple[int, int]:
    values = _int_list(name, text, 1)
    if len(values) != 2:
        raise CliError(f"{name} takes PROMPT,GENERATED (two integers), got {text!r}", 2)
    return values[0], values[1]


PREEMPTION_SETS = {"checkpoint_share": "the whole budget is the requests' (0)"}


@bench_app.command("preemption")
@model_options(dtype="bfloat16", cache_memory="12MiB", max_model_len=4096, max_num_seqs=8,
               refuse=PREEMPTION_SETS)
def preemption(
    options: ModelOptions,
    long: Annotated[str, typer.Option(
        "--long", help="The long request: PROMPT,GENERATED tokens.")] = "3000,1000",
    short: Annotated[str, typer.Option(
        "--short", help="Each short request: PROMPT,GENERATED tokens.")] = "1000,400",
    num_short: Annotated[int, typer.Option(
        "--num-short", min=0, help="Short requests beside the long one.")] = 6,
    rounds: Annotated[int, typer.Option(
        "--rounds", min=1, help="Runs of each rule, alternated (the median wall time is "
        "reported).")] = 1,
    check_alone: Annotated[bool, typer.Option(
        "--check-alone", help="Also run each request alone and report whether both rules' "
        "greedy outputs equal those (exact in float32) (default: off).")] = False,
    json_path: JsonOpt = None,
) -> None:
    """Memory pressure: one long request beside short ones in a small cache, under the
    scheduler's admission control and the earlier chunk rule, alternated on one engine:
    preemptions, tokens prefilled again, steps, wall time. The default --cache-memory is too
    small for the whole workload at once."""
    from hybridrt.cli.common import resolve_model

    options = options.checked()
    max_model_len = options.max_model_len
    long_pair, short_pair = _pair("--long", long), _pair("--short", short)
    need = max(sum(long_pair), sum(short_pair))
    if max_model_len is not None and need > max_model_len:
        raise CliError(f"a request of {need} tokens does not fit --max-model-len "
                       f"{max_model_len}", 2)
    path = resolve_model(options.model)
    from hybridrt.bench.preemption import run_preemption_bench

    own = ("dtype", "cache_memory", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
           "threads")
    run_preemption_bench(path, **{k: getattr(options, k) for k in own}, long=long_pair,
                         short=short_pair, num_short=num_short, rounds=rounds,
                         check_alone=check_alone, json_path=json_path,
                         engine=options.llm_kwargs(*PREEMPTION_SETS, *own))


# steps ---------------------------------------------------------------------------------------
STEPS_SETS = {"quantization": "--weights sets each engine's",
              "max_num_seqs": "the largest --batch"}


@bench_app.command("steps")
@model_options(dtype="bfloat16", cache_memory="0.2", max_model_len=512, threads=2,
               refuse=STEPS_SETS)
def steps(
    options: ModelOptions,
    batch: Annotated[str, typer.Option(
        "--batch", help="Comma-separated batch sizes (sequences decoding side by side).")] = "1",
    weights: Annotated[str, typer.Option(
        "--weights", help="Comma-separated weight kinds: none (the checkpoint's dtype), int8, "
        "int4; an engine each, rounds alternated.")] = "none",
    num_steps: Annotated[int, typer.Option(
        "--steps", min=1, help="Decode steps timed per round.")] = 32,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Alternated rounds.")] = 3,
    cpu_time: Annotated[bool, typer.Option(
        "--cpu-time", help="Every time in this process's CPU seconds (a busy machine; with "
        "--threads 1) (default: off).")] = False,
    no_program: Annotated[bool, typer.Option(
        "--no-program", help="The decode layers called one by one (HYBRIDRT_STEP_PROGRAM=0): "
        "each kernel's time shows (default: off).")] = False,
    json_path: JsonOpt = None,
) -> None:
    """Where a decode step goes: ms a step in each compiled call (fused layers, norms,
    products, LM head) per batch size and weight kind, rounds alternated. Each engine (one per
    --weights kind) has the --cache-memory budget: it must hold every batch."""
    from hybridrt.cli.common import resolve_model

    options = options.checked()
    batches = _int_list("--batch", batch, 1)
    kinds = [w.strip().lower() for w in weights.split(",") if w.strip()]
    bad = [w for w in kinds if w not in ("none", "bf16", "int8", "int4")]
    if bad or not kinds:
        raise CliError(f"--weights: unknown kind(s) {bad or kinds}; choose from none, int8, "
                       f"int4", 2)
    path = resolve_model(options.model)
    from hybridrt.bench.steps import run

    own = ("dtype", "cache_memory", "max_model_len", "threads")
    try:
        run(path, batches=tuple(batches), steps=num_steps, rounds=rounds,
            quantizations=tuple(None if w in ("none", "bf16") else w for w in kinds),
            **{k: getattr(options, k) for k in own}, cpu_time=cpu_time,
            no_program=no_program, json_path=json_path,
            engine=options.llm_kwargs(*STEPS_SETS, *own))
    except ValueError as e:
        raise CliError(str(e), 1) from None


# prefix-policy -------------------------------------------------------------------------------
POLICY_SETS = {
    "max_num_seqs": "16",
    "enable_prefix_caching": "it measures the prefix cache",
    "checkpoint_interval": "each placement sets it",
    "checkpoint_share": "0.5",
}


@bench_app.command("prefix-policy")
@model_options(cache_memory="6GiB", max_model_len=4096, threads=2, refuse=POLICY_SETS)
def prefix_policy(
    options: ModelOptions,
    workloads: Annotated[str, typer.Option(
        "--workloads", help="Comma-separated: shared, agent, chat, document, raw.")
    ] = "shared,agent,chat,document,raw",
    scale: Annotated[float, typer.Option(
        "--scale", min=0.001, help="Every workload's message sizes times this.")] = 1.0,
    max_tokens: Annotated[int, typer.Option(
        "--max-tokens", min=1, help="Tokens generated per request.")] = 16,
    json_path: JsonOpt = None,
) -> None:
    """What each GDN checkpoint placement (message starts, a token interval) costs and buys on
    four chat-shaped workloads: tokens prefilled, hit rate, checkpoints saved and held. The
    default --cache-memory is large enough that nothing is evicted."""
    from hybridrt.bench import prefix_policy as policybench
    from hybridrt.cli.common import resolve_model

    chosen = tuple(w.strip() for w in workloads.split(",") if w.strip())
    bad = [w for w in chosen if w not in policybench.WORKLOADS]
    if bad or not chosen:
        raise CliError(f"--workloads: unknown workload(s) {bad or chosen}; choose from "
                       f"{', '.join(policybench.WORKLOADS)}", 2)
    options = options.checked()
    own = ("threads", "cache_memory", "max_model_len")
    try:
        policybench.run(resolve_model(options.model), **{k: getattr(options, k) for k in own},
                        scale=scale, max_tokens=max_tokens, chosen=chosen, json_path=json_path,
                        engine=options.llm_kwargs(*POLICY_SETS, *own))
    except ValueError as e:
        raise CliError(str(e), 2) from None


# structured ----------------------------------------------------------------------------------
STRUCTURED_SETS = {"max_model_len": "256", "max_num_seqs": "the largest --batch"}


@bench_app.command("structured")
@model_options(threads=2, refuse=STRUCTURED_SETS)
def structured(
    options: ModelOptions,
    batch: Annotated[str, typer.Option(
        "--batch", help="Comma-separated batch sizes.")] = "1,32",
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Alternated rounds.")] = 3,
    tokens: Annotated[int, typer.Option(
        "--tokens", min=2, help="Tokens generated per request.")] = 24,
    cpu_time: Annotated[bool, typer.Option(
        "--cpu-time", help="Decode steps timed in this process's CPU time (a busy machine; "
        "with --threads 1) (default: off).")] = False,
    json_path: JsonOpt = None,
) -> None:
    """The cost of structured outputs: decode-step time with a JSON schema on every request
    against none, and a schema's compile time (cold, new, cached)."""
    batches = _int_list("--batch", batch, 1)
    if all(importlib.util.find_spec(m) is None for m in ("llguidance", "xgrammar")):
        raise CliError("hybridrt bench structured needs a grammar engine: pip install "
                       "'hybridrt[structured]'", 2)
    from hybridrt.bench.structured import run
    from hybridrt.cli.common import resolve_model

    options = options.checked()
    run(resolve_model(options.model), threads=options.threads, batches=tuple(batches),
        rounds=rounds, tokens=tokens, cpu_time=cpu_time, json_path=json_path,
        engine=options.llm_kwargs(*STRUCTURED_SETS, "threads"))


@bench_app.command("llamacpp-build")
def llamacpp_build(
    home: Annotated[Path | None, typer.Option(
        "--home", metavar="DIR", help="Where the source and build go (default: $LLAMACPP_HOME, "
        "else ~/.cache/hybridrt-llamacpp, where --llamacpp-bin looks).", show_default=False)
    ] = None,
    jobs: Annotated[int | None, typer.Option(
        "--jobs", min=1, help="Parallel compile jobs (default: the CPU count).",
        show_default=False)] = None,
) -> None:
    """Download llama.cpp's source as vendored in the llama-cpp-python sdist of a pinned version
    and build llama-bench, llama-batched-bench, llama-quantize and llama-perplexity for this CPU
    without ggml's AMX kernels (cmake and a C++ compiler needed); what is already there is
    kept, a build made with other settings is built again."""
    from hybridrt.bench import llamacpp_build

    try:
        where = llamacpp_build.build(llamacpp_build.plan(home, jobs=jobs))
    except llamacpp_build.LlamaCppBuildError as e:
        raise CliError(str(e)) from None
    typer.echo(str(where))


@bench_app.command("llamacpp-convert")
def llamacpp_convert(
    ckpt: Annotated[Path, typer.Argument(help="A Qwen3.5 checkpoint folder with its "
                                              "tokenizer.json.", show_default=False)],
    out: Annotated[Path, typer.Argument(help="The GGUF file to write.", show_default=False)],
    outtype: Annotated[str, typer.Argument(
        help="f32, f16, bf16 or q8_0 (the converter's), or any type llama-quantize lists "
        "(e.g. Q4_K_M, Q4_0: converted to bf16, then quantized).")] = "bf16",
    home: Annotated[Path | None, typer.Option(
        "--home", metavar="DIR", help="Where llamacpp-build put llama.cpp (default: "
        "$LLAMACPP_HOME, else ~/.cache/hybridrt-llamacpp).", show_default=False)] = None,
) -> None:
    """Convert a checkpoint to GGUF with llama.cpp's own converter (from llamacpp-build's
    source), a tokenizer that splits as Qwen3.5's but is unknown to it (the demo model's)
    named qwen35; MTP layers left out. Prints the GGUF's path."""
    from hybridrt.bench import llamacpp_convert as conv

    try:
        p = conv.plan(ckpt, out, outtype, home=home)
    except conv.LlamaCppConvertError as e:
        raise CliError(str(e), 2) from None
    try:
        typer.echo(str(conv.convert(p)))
    except conv.LlamaCppConvertError as e:
        raise CliError(str(e)) from None


@bench_app.command("long")
def long(
    model: Annotated[str | None, typer.Argument(
        metavar="MODEL", show_default=False, help="Checkpoint dir (default: a random-weight "
        "Qwen3.5-0.8B-shaped checkpoint).")] = None,
    lengths: Annotated[str, typer.Option(
        "--lengths", help="Comma-separated prompt lengths whose prefill is measured.")
    ] = "4096,16384,65536",
    depths: Annotated[str, typer.Option(
        "--depths", help="Comma-separated cached-token counts after which decode is measured.")
    ] = "0,4096,16384,65536",
    weights: Annotated[str, typer.Option(
        "--weights", help="Comma-separated weight formats: bf16, int8, int4.")] = "bf16,int4",
    kv: Annotated[str, typer.Option(
        "--kv", help="Comma-separated KV cache dtypes: bf16, int8.")] = "bf16,int8",
    decode_tokens: Annotated[int, typer.Option(
        "--decode-tokens", min=1, help="Decode steps timed per depth.")] = 8,
    threads: ThreadsOpt = None,
    against_llamacpp: Annotated[Path | None, typer.Option(
        "--against-llamacpp", metavar="GGUF", help="Also run llama.cpp's bench-long "
        "(../shared/tools/llamacpp-bench) on this GGUF of the same model (default: off).",
        show_default=False)] = None,
    json_path: JsonOpt = None,
) -> None:
    """Prefill of long prompts and decode after long contexts, bf16 and int4 weights, bf16 and
    int8 KV, with the attention's share of each (hybridrt/bench/long.py)."""
    lens = _int_list("--lengths", lengths, 1)
    deps = _int_list("--depths", depths, 0)
    ws = _choices("--weights", weights, WEIGHT_FORMATS, "format")
    kvs = _choices("--kv", kv, KV_DTYPES, "KV dtype")
    from hybridrt.bench import long as bench

    bench.run(model, ws, kvs, lens, deps, decode_tokens, threads or _default_threads(),
              gguf=against_llamacpp, json_path=json_path)


@bench_app.command("responsive")
def responsive(
    model: Annotated[str | None, typer.Argument(
        metavar="MODEL", show_default=False, help="Checkpoint dir (default: a random-weight "
        "Qwen3.5-0.8B-shaped checkpoint).")] = None,
    prompt_len: Annotated[int, typer.Option(
        "--prompt-len", min=2, help="Tokens of the long prompt prefilled meanwhile.")] = 32768,
    budget: Annotated[int, typer.Option(
        "--max-num-batched-tokens", min=2, help="The step budget (prefill chunk + decode "
        "tokens).")] = 2048,
    weights: Annotated[str, typer.Option(
        "--weights", help="Weight format: bf16, int8, int4.")] = "bf16",
    kv: Annotated[str, typer.Option("--kv", help="KV cache dtype: bf16, int8.")] = "bf16",
    threads: ThreadsOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """A request's inter-token gaps while another prefills a long prompt in chunks of the step
    budget (hybridrt/bench/responsive.py)."""
    _choice("--weights", weights, WEIGHT_FORMATS, "format")
    _choice("--kv", kv, KV_DTYPES, "KV dtype")
    from hybridrt.bench import responsive as bench

    bench.run(model, prompt_len, budget, threads or _default_threads(), kv, weights,
              json_path=json_path)


@bench_app.command("kv-quality")
def kv_quality(
    n_ctx: Annotated[int, typer.Option(
        "--ctx", min=16, help="Tokens per window of the held-out text (each from an empty "
        "cache; its second half scored).")] = 2048,
    chunk: Annotated[int, typer.Option(
        "--chunk", min=1, help="Prompt chunk the windows are prefilled in.")] = 512,
    max_windows: Annotated[int | None, typer.Option(
        "--max-windows", min=1, help="Score only the first N windows (default: all).",
        show_default=False)] = None,
    threads: ThreadsOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """int8 against bf16 KV on the demo model over held-out text: perplexity, KL, greedy
    agreement (hybridrt/bench/kv_quality.py)."""
    from hybridrt.bench import kv_quality as bench

    try:
        bench.run(n_ctx, chunk, threads or _default_threads(), max_windows, json_path=json_path)
    except ValueError as e:
        raise CliError(str(e), 2) from None


@bench_app.command("attention")
def attention(
    lengths: Annotated[str, typer.Option(
        "--lengths", help="Comma-separated context lengths.")] = "2048,4096,8192",
    chunk: Annotated[int, typer.Option(
        "--chunk", min=1, help="Queries of the prompt chunk at the end of each context.")
    ] = 2048,
    kv: Annotated[str, typer.Option(
        "--kv", help="Comma-separated KV cache dtypes: bf16, int8.")] = "bf16,int8",
    repeats: Annotated[int, typer.Option("--repeats", min=1, help="Timed calls, best kept.")
                       ] = 5,
    verify_rows: Annotated[str, typer.Option(
        "--verify-rows", help="Comma-separated rows of one sequence per decode call (1 + the "
        "drafts a verification step checks).")] = "1",
    threads: ThreadsOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """One attention layer of the 0.8B shape over a long context: the prompt chunk's tiled
    attention against SDPA over the whole context, and the decode kernel
    (hybridrt/bench/prompt_attention.py)."""
    lens = _int_list("--lengths", lengths, 1)
    kvs = _choices("--kv", kv, KV_DTYPES, "KV dtype")
    from hybridrt.bench import prompt_attention as bench

    verify = _int_list("--verify-rows", verify_rows, 1)
    bench.run(lens, chunk, kvs, threads or _default_threads(), repeats, json_path=json_path,
              verify=verify)
