"""llama.cpp as a yardstick for ``hybridrt bench throughput --against-llamacpp GGUF``: runs
llama.cpp's own ``llama-bench`` (prefill, batch-1 decode) and ``llama-batched-bench`` (decode at
each concurrency, its S_TG figure) on the same work and threads, and reads their JSON lines.

The binaries are looked up in ``--llamacpp-bin DIR``, else ``$LLAMACPP_HOME/llama.cpp/build/bin``
(``LLAMACPP_HOME`` defaults to ``~/.cache/hybridrt-llamacpp``, where
``hybridrt bench llamacpp-build`` puts them, hybridrt.bench.llamacpp_build). llama.cpp
benchmarks its own random prompt tokens."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("llama-bench", "llama-batched-bench")
ENGINES = ("hybridrt", "llamacpp")
DEFAULT_ORDER = ("hybridrt", "llamacpp", "hybridrt", "llamacpp")  # rounds, alternated


def check_order(order: list[str] | tuple[str, ...]) -> list[str]:
    """The rounds of ``--against-llamacpp``, in order: names from ``ENGINES``, each at least once
    (ValueError with one line otherwise)."""
    order = list(order)
    if any(e not in ENGINES for e in order) or set(order) != set(ENGINES):
        raise ValueError(f"--order needs hybridrt and llamacpp, each at least once (e.g. "
                         f"{','.join(DEFAULT_ORDER)}), got {','.join(order) or 'nothing'}")
    return order


class LlamaCppError(RuntimeError):
    """llama.cpp is missing, failed, or did not run the work asked of it."""


def bin_dir(explicit: str | Path | None = None) -> Path:
    """Where the llama.cpp binaries are expected (see the module docstring)."""
    if explicit is not None:
        return Path(explicit)
    from hybridrt.bench.llamacpp_build import plan

    return plan().bin


def check(gguf: str | Path, bins: str | Path | None = None) -> Path:
    """The binaries' folder, after checking that the GGUF file and both binaries exist
    (``LlamaCppError`` with one line naming what is missing otherwise)."""
    if not Path(gguf).is_file():
        raise LlamaCppError(f"--against-llamacpp: no GGUF file at {gguf}")
    where = bin_dir(bins)
    missing = [b for b in BINARIES if not os.access(where / b, os.X_OK)]
    if missing:
        raise LlamaCppError(f"llama.cpp binaries not found: {', '.join(missing)} in {where} "
                            f"(run hybridrt bench llamacpp-build, or pass --llamacpp-bin DIR)")
    return where


def _vm_hwm(pid: int) -> int:
    """A running process's peak resident memory so far in bytes (0 once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_child(cmd: list[str], poll_s: float = 0.05) -> tuple[str, int]:
    """Run ``cmd`` -> (its stdout, its peak resident memory in bytes). The peak is its VmHWM,
    read every ``poll_s`` while it runs: the rusage of a child also counts this process's memory
    at the fork, where Python forks it."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, _vm_hwm(proc.pid))
            time.sleep(poll_s)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            tail = err.read().decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise LlamaCppError(f"{Path(cmd[0]).name} exited with {proc.returncode}: {tail[0]}")
        return out.read().decode(errors="replace"), peak


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def parse_llama_bench(text: str) -> dict:
    """``llama-bench -o jsonl`` output (one prompt test, one generation test) ->
    {"prefill_tok_s", "decode_b1_tok_s", "n_prompt", "n_gen", "threads", "model_bytes"}."""
    rows = _json_lines(text)
    pp = [r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0]
    tg = [r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0]
    if len(pp) != 1 or len(tg) != 1:
        raise LlamaCppError(f"llama-bench: expected one prompt and one generation test, got "
                            f"{len(pp)} and {len(tg)} in {len(rows)} JSON lines")
    (pp,), (tg,) = pp, tg
    return {"prefill_tok_s": pp["avg_ts"], "decode_b1_tok_s": tg["avg_ts"],
            "n_prompt": pp["n_prompt"], "n_gen": tg["n_gen"], "threads": tg["n_threads"],
            "model_bytes": tg["model_size"]}


def parse_batched_bench(text: str) -> dict[int, dict]:
    """``llama-batched-bench --output-format jsonl`` output -> {parallel sequences: {"decode_tok_s"
    (S_TG: pl x tg new tokens over the decode time), "prompt_len", "new_tokens", "threads"}}."""
    out = {}
    for r in _json_lines(text):
        out[r["pl"]] = {"decode_tok_s": r["speed_tg"], "prompt_len": r["pp"], "new_tokens": r["tg"],
                        "threads": r["n_threads"]}
    if not out:
        raise LlamaCppError("llama-batched-bench: no JSON lines in its output")
    return out


def context_size(prompt_len: int, new_tokens: int, concurrency: list[int]) -> int:
    """A ``-c`` that holds every sequence of the largest batch, rounded up to 256."""
    need = max(concurrency) * (prompt_len + new_tokens)
    return -(-need // 256) * 256


def bench(gguf: str | Path, bins: Path, threads: int, prefill_len: int, prompt_len: int,
          decode_tokens: int, concurrency: list[int]) -> tuple[dict, dict, dict]:
    """Run both llama.cpp benchmarks once -> (results keyed like hybridrt's rows, the work each
    row ran, {"peak_rss_gib", "model_bytes"}). Raises ``LlamaCppError`` if llama.cpp ran other
    work (prompt or generation lengths, sequences, threads) than asked."""
    text, rss_a = run_child([str(bins / "llama-bench"), "-m", str(gguf), "-t", str(threads),
                             "-p", str(prefill_len), "-n", str(decode_tokens), "-r", "1",
                             "-o", "jsonl"])
    single = parse_llama_bench(text)
    res = {"prefill_tok_s": single["prefill_tok_s"], "decode_b1_tok_s": single["decode_b1_tok_s"]}
    work = {"prefill_tok_s": {"requests": 1, "prompt_len": single["n_prompt"], "new_tokens": 0},
            "decode_b1_tok_s": {"requests": 1, "prompt_len": 0, "new_tokens": single["n_gen"]}}
    rss_b = 0
    if concurrency:
        text, rss_b = run_child([
            str(bins / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
            "-c", str(context_size(prompt_len, decode_tokens, concurrency)),
            "-npp", str(prompt_len), "-ntg", str(decode_tokens),
            "-npl", ",".join(map(str, concurrency)), "--output-format", "jsonl"])
        batched = parse_batched_bench(text)
        for c in concurrency:
            if c not in batched:
                raise LlamaCppError(f"llama-batched-bench gave no result for {c} sequences")
            row = batched[c]
            ran = (row["prompt_len"], row["new_tokens"], row["threads"])
            if ran != (prompt_len, decode_tokens, threads):
                raise LlamaCppError(f"llama-batched-bench ran (prompt, new tokens, threads) "
                                    f"{ran}, not {(prompt_len, decode_tokens, threads)}")
            res[f"decode_b{c}_tok_s"] = row["decode_tok_s"]
            work[f"decode_b{c}_tok_s"] = {"requests": c, "prompt_len": row["prompt_len"],
                                          "new_tokens": row["new_tokens"]}
    ran = (single["n_prompt"], single["n_gen"], single["threads"])
    if ran != (prefill_len, decode_tokens, threads):
        raise LlamaCppError(f"llama-bench ran (prompt, new tokens, threads) {ran}, not "
                            f"{(prefill_len, decode_tokens, threads)}")
    extra = {"peak_rss_gib": max(rss_a, rss_b) / 2**30, "model_bytes": single["model_bytes"]}
    return res, work, extra


def ratios(ours: dict, theirs: dict) -> dict:
    """hybridrt / llama.cpp for every row both have."""
    return {k: ours[k] / theirs[k] for k in theirs if k in ours and theirs[k]}
