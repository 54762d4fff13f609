"""Decode speed beside a busy process: the default thread settings against explicit choices.

    hybridrt bench busy [MODEL] [--tokens 64] [--rounds 2] [--json out.json]

For each condition (the machine as it is; and with one extra CPU-bound process started by the
benchmark, a pure-Python loop) batch-1 decode runs in fresh interpreters, alternated:
hybridrt's default (threads fitted to the free cores), each explicit ``--threads`` from 1 to
the number of cores, all cores without the fitting (``HYBRIDRT_ADAPTIVE_THREADS=0``) and the
same with idle OpenMP workers sleeping (``OMP_WAIT_POLICY=PASSIVE``; hybridrt/threads.py).
Reports the median tok/s of each and the default's ratio to the
best explicit choice. The model defaults to the demo model; the 0.8B figures in
docs/performance.md come from a random-weight 0.8B checkpoint (``--model DIR``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_PROBE = r"""
import json, sys
import torch
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
model, threads, tokens = sys.argv[1] or None, int(sys.argv[2]) or None, int(sys.argv[3])
llm = LLM(model, **json.loads(sys.argv[4]), threads=threads, max_num_seqs=1, max_model_len=64,
          tokenizer=None, cache_memory=64 << 20)
prompt = [list(range(10, 26))]
llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
             use_tqdm=False)
sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
(out,) = llm.generate(prompt, sp, use_tqdm=False)
print(json.dumps({"tok_s": out.metrics["decode_tokens_per_s"],
                  "threads": torch.get_num_threads()}))
"""

_SPIN = "while True: pass"


def _die_with_parent() -> None:
    """In the spinner, before it runs: the kernel kills it when this benchmark dies, however it
    dies (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``), so a killed run leaves no core busy."""
    import contextlib
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))


def _spinner() -> subprocess.Popen:
    """The competing CPU-bound process."""
    linux = sys.platform.startswith("linux")
    return subprocess.Popen([sys.executable, "-c", _SPIN],
                            preexec_fn=_die_with_parent if linux else None)


def _variants(cores: int) -> dict[str, tuple[dict, int]]:
    """name -> (environment changes, --threads or 0 for the default)."""
    out = {"default": ({}, 0)}
    for t in range(1, cores + 1):
        out[f"--threads {t}"] = ({}, t)
    out["all cores (previous default)"] = ({"HYBRIDRT_ADAPTIVE_THREADS": "0"}, 0)
    out["all cores, passive wait"] = ({"HYBRIDRT_ADAPTIVE_THREADS": "0",
                                       "OMP_WAIT_POLICY": "PASSIVE"}, 0)
    return out


def _probe(model: str | None, env: dict, threads: int, tokens: int,
           engine: dict | None = None) -> float:
    drop = ("OMP_WAIT_POLICY", "HYBRIDRT_ADAPTIVE_THREADS")
    full = {k: v for k, v in os.environ.items() if k not in drop}
    full.update(env)
    proc = subprocess.run([sys.executable, "-c", _PROBE, model or "", str(threads), str(tokens),
                           json.dumps(engine or {})],
                          capture_output=True, text=True, env=full, stdin=subprocess.DEVNULL,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the decode probe failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["tok_s"]


def measure_busy(model: str | None = None, tokens: int = 64, rounds: int = 2,
                 cores: int | None = None, engine: dict | None = None) -> dict:
    """-> the report: per condition and variant the median decode tok/s, and per condition the
    default's ratio to the best explicit ``--threads``. ``engine``: further ``LLM`` keyword
    arguments of every probe (the command line's model options but those it sets itself)."""
    from hybridrt.bench import progress

    cores = cores or len(os.sched_getaffinity(0))
    variants = _variants(cores)
    pbar = progress.bar("busy", 2 * rounds * len(variants), unit="process")
    report: dict = {"model": model or "demo model", "tokens": tokens, "rounds": rounds,
                    "cores": cores, "load_before": os.getloadavg(), "conditions": {}}
    for condition in ("as is", "one busy process"):
        spin = None
        if condition == "one busy process":
            spin = _spinner()
        try:
            rates: dict[str, list[float]] = {name: [] for name in variants}
            for r in range(rounds):
                for name, (env, threads) in variants.items():
                    progress.step(pbar, f"{condition}, round {r + 1}: {name}")
                    rates[name].append(_probe(model, env, threads, tokens, engine))
                    pbar.update()
        finally:
            if spin is not None:
                spin.kill()
                spin.wait()
        med = {name: statistics.median(v) for name, v in rates.items()}
        best = max(v for k, v in med.items() if k.startswith("--threads"))
        report["conditions"][condition] = {
            "tok_s": med, "runs": rates, "default_over_best_explicit": med["default"] / best,
        }
    pbar.close()
    report["load_after"] = os.getloadavg()
    return report


def format_report(r: dict) -> str:
    lines = [f"batch-1 decode of {r['model']}, {r['tokens']} tokens, tok/s (median of "
             f"{r['rounds']} alternated fresh processes), {r['cores']} cores; load average "
             f"before {r['load_before'][0]:.2f}, after {r['load_after'][0]:.2f}"]
    names = list(next(iter(r["conditions"].values()))["tok_s"])
    conds = list(r["conditions"])
    lines.append(f"{'':<32}" + "".join(f"{c:>20}" for c in conds))
    for n in names:
        lines.append(f"{n:<32}" + "".join(f"{r['conditions'][c]['tok_s'][n]:>20.2f}"
                                          for c in conds))
    lines.append(f"{'default / best --threads':<32}" + "".join(
        f"{r['conditions'][c]['default_over_best_explicit']:>19.2f}x" for c in conds))
    return "\n".join(lines)


def run_busy_bench(model: str | None = None, tokens: int = 64, rounds: int = 2,
                   json_path: str | Path | None = None, engine: dict | None = None) -> dict:
    report = measure_busy(model, tokens, rounds, engine=engine)
    print(format_report(report))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_path}", file=sys.stderr)
    return report
