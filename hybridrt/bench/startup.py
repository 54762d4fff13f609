"""Start-up benchmark: how long a first user waits, each figure from a fresh interpreter.

    hybridrt bench startup [MODEL] [--runs 5] [--json out.json]

Measures, alternating the runs so that a change in a shared machine's speed hits all alike:

- ``import torch``: ``python -c "import torch"``, the floor of anything that runs a model;
- ``generate``: ``python -m hybridrt generate -p hi --max-tokens 1`` end to end (load and
  first token of the model, the demo model by default); the figure that matters is its
  excess over ``import torch`` (target: 1.5 s);
- ``usage error``: the same command with a bad flag, which must not wait for torch;
- the phases of one load in a fresh process: imports, ``LLM(...)``, the first token;
- with ``--against-llamacpp GGUF`` (MODEL then usually the same GGUF file): llama.cpp's
  start-up to the first token on that file, ``llama-bench -p 2 -n 0 -r 1 --no-warmup``
  (load, context, a 2-token prompt; the same threads), alternated with the rest.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

TARGET_EXCESS_S = 1.5

_PHASES = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
t2 = time.perf_counter()
model, threads = sys.argv[1] or None, int(sys.argv[2]) or None
llm = LLM(model, **json.loads(sys.argv[3]), threads=threads)
t3 = time.perf_counter()
llm.generate("hi", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
t4 = time.perf_counter()
print(json.dumps({"import_torch": t1 - t0, "import_hybridrt": t2 - t1, "load": t3 - t2,
                  "first_token": t4 - t3, "dtype": str(llm.dtype).removeprefix("torch."),
                  "threads": torch.get_num_threads()}))
"""


def _timed(args: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, check=False,
                          stdin=subprocess.DEVNULL)
    return time.perf_counter() - t, proc


def llamacpp_command(gguf: str | Path, threads: int | None,
                     bins: str | Path | None = None) -> list[str]:
    """llama.cpp's start-up to its first token on ``gguf``: load, context and a 2-token
    prompt, one run, no warm-up (``LlamaCppError`` when the file or llama-bench is missing)."""
    from hybridrt.bench import llamacpp

    where = llamacpp.check(gguf, bins)
    return [str(where / "llama-bench"), "-m", str(gguf), "-p", "2", "-n", "0", "-r", "1",
            "--no-warmup", *(["-t", str(threads)] if threads else [])]


def measure_startup(model: str | None = None, runs: int = 5,
                    threads: int | None = None, engine: dict | None = None,
                    engine_flags: Sequence[str] = (), against_llamacpp: str | Path | None = None,
                    llamacpp_bin: str | Path | None = None) -> dict:
    """-> the report: per measurement the median and every run's seconds, and the excess of
    generate over import torch. ``engine`` / ``engine_flags``: the command line's model
    options but --threads, as the phase probe's ``LLM`` keyword arguments / as generate's
    flags (the same options both). ``against_llamacpp``: a GGUF file llama.cpp starts on too
    (``llamacpp_command``)."""
    theirs = None
    if against_llamacpp:
        import torch  # generate's default threads, which llama.cpp is given too

        theirs = llamacpp_command(against_llamacpp, threads or torch.get_num_threads(),
                                  llamacpp_bin)
    py = sys.executable
    cli = [py, "-m", "hybridrt", "generate", *([model] if model else []), "-p", "hi",
           "--max-tokens", "1", "--temperature", "0", "--no-progress",
           *(["--threads", str(threads)] if threads else []), *engine_flags]
    commands = {
        "import_torch": [py, "-c", "import torch"],
        "generate": cli,
        "usage_error": [py, "-m", "hybridrt", "generate", "-p", "hi", "--temperature", "-1"],
        **({"llamacpp": theirs} if theirs else {}),
    }
    from hybridrt.bench import progress

    pbar = progress.bar("startup", runs * (len(commands) + 1), unit="process")
    times: dict[str, list[float]] = {name: [] for name in commands}
    for r in range(runs):
        for name, args in commands.items():
            progress.step(pbar, f"run {r + 1}: {name.replace('_', ' ')}")
            dt, proc = _timed(args)
            pbar.update()
            want = 2 if name == "usage_error" else 0
            if proc.returncode != want:
                raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}, not {want}: "
                                   f"{proc.stderr.strip()[-500:]}")
            times[name].append(dt)
    phases = []
    for r in range(runs):
        progress.step(pbar, f"run {r + 1}: phases")
        _, proc = _timed([py, "-c", _PHASES, model or "", str(threads or 0),
                             json.dumps(engine or {})])
        pbar.update()
        if proc.returncode != 0:
            raise RuntimeError(f"the phase probe failed: {proc.stderr.strip()[-500:]}")
        phases.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    pbar.close()
    med = {name: statistics.median(v) for name, v in times.items()}
    excess = [g - t for g, t in zip(times["generate"], times["import_torch"])]
    report = {
        "model": model or "demo model",
        "runs": runs,
        "median_s": med,
        "runs_s": times,
        "generate_minus_import_torch_s": statistics.median(excess),
        "target_s": TARGET_EXCESS_S,
        "phases_median_s": {k: statistics.median(p[k] for p in phases)
                            for k in ("import_torch", "import_hybridrt", "load", "first_token")},
        "dtype": phases[0]["dtype"],
        "threads": phases[0]["threads"],
    }
    if theirs:
        report["llamacpp_gguf"] = str(against_llamacpp)
        report["generate_over_llamacpp"] = med["generate"] / med["llamacpp"]
    return report


def format_report(r: dict) -> str:
    m, p = r["median_s"], r["phases_median_s"]
    excess = r["generate_minus_import_torch_s"]
    lines = [
        f"start-up of {r['model']} ({r['dtype']}, {r['threads']} threads), median of "
        f"{r['runs']} alternated runs, each a fresh interpreter:",
        f"  python -c 'import torch'                      {m['import_torch']:6.2f} s",
        f"  hybridrt generate -p hi --max-tokens 1        {m['generate']:6.2f} s",
        f"    load + first token beyond import torch      {excess:6.2f} s  "
        f"(target {r['target_s']:.1f} s: {'met' if excess <= r['target_s'] else 'missed'})",
        f"  usage error (--temperature -1)                {m['usage_error']:6.2f} s",
        *([f"  llama.cpp: llama-bench -p 2 -n 0 --no-warmup  {m['llamacpp']:6.2f} s  "
           f"(hybridrt generate takes {r['generate_over_llamacpp']:.2f}x as long; "
           f"{Path(r['llamacpp_gguf']).name})"] if "llamacpp" in m else []),
        "  one load, by phase: "
        + ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in p.items()),
    ]
    return "\n".join(lines)


def run_startup_bench(model: str | None = None, runs: int = 5, threads: int | None = None,
                      json_path: str | Path | None = None, engine: dict | None = None,
                      engine_flags: Sequence[str] = (), against_llamacpp: str | Path | None = None,
                      llamacpp_bin: str | Path | None = None) -> dict:
    report = measure_startup(model, runs, threads, engine, engine_flags, against_llamacpp,
                             llamacpp_bin)
    print(format_report(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return report
