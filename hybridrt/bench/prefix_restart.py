"""``hybridrt bench prefix --workloads restart``: the prefix cache's disk tier across a restart.

A conversation of ``turns`` turns (each adds a user message of ``message_tokens`` random token
ids; greedy answers of ``max_tokens`` tokens) in the batch-invariant mode, each part in a
process of its own (a restart loses everything in memory):

- unrestarted: one process on its own directory runs every turn;
- restarted: one process runs turns 1..``restart_after`` on a directory and exits, a new one
  started on the same directory runs the rest;
- damaged: the same restart, with the directory's newest checkpoint file truncated, or with one
  byte of it flipped, before the new process starts.

Reported per run and turn: prompt tokens, tokens resumed from the cache (from disk in the
first turn after a restart), tokens prefilled; whether every answer (token ids and logprobs)
is bit for bit the unrestarted run's; the disk tier's log lines about skipped files.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import shutil
import tempfile
import time
from pathlib import Path

import torch

DAMAGES = ("truncated", "flipped")


def _messages(vocab: int, turns: int, n: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for _ in range(turns)]


def _turns(model: str, kwargs: dict, directory: str, history: list[int],
           messages: list[list[int]], max_tokens: int, queue) -> None:
    """One process's part of the conversation (run in a fresh, spawned process)."""
    from hybridrt import LLM, SamplingParams

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logging.getLogger("hybridrt.prefix_disk").addHandler(Keep())
    t0 = time.perf_counter()
    llm = LLM(model, prefix_cache_dir=directory, batch_invariant=True, **kwargs)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    rows = []
    for m in messages:
        prompt = history + m
        t = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        if out.error is not None:
            raise RuntimeError(f"turn failed: {out.error}")
        ids = list(out.outputs[0].token_ids)
        rows.append({"prompt_tokens": len(prompt), "cached_tokens": out.num_cached_tokens,
                     "prefilled_tokens": len(prompt) - out.num_cached_tokens,
                     "seconds": time.perf_counter() - t, "token_ids": ids,
                     "logprobs": json.dumps(out.outputs[0].logprobs, default=str)})
        history = prompt + ids
    stats = dict(llm.engine.cache.prefix.stats)
    queue.put({"rows": rows, "history": history, "load_s": load_s, "log": lines,
               "disk_hit_tokens": stats.get("disk_hit_tokens", 0)})


def _in_process(*args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_turns, args=(*args, queue))
    proc.start()
    try:
        got = queue.get(timeout=3600)
    finally:
        proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"a conversation process exited with {proc.exitcode}")
    return got


def _damage(directory: Path, how: str) -> str:
    """The newest checkpoint file (the conversation's end before the restart), damaged."""
    path = max((directory / "ckpts").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        raw = raw[:-100]
    else:
        raw[len(raw) * 2 // 3] ^= 0x40
    path.write_bytes(bytes(raw))
    return path.name


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(x["token_ids"] == y["token_ids"] and x["logprobs"] == y["logprobs"]
               for x, y in zip(a, b, strict=True))


def run(model: str, turns: int = 6, restart_after: int = 3, message_tokens: int = 200,
        max_tokens: int = 16, engine: dict | None = None, verbose: bool = True) -> dict:
    """-> the report (module docstring). ``engine``: further ``LLM`` keyword arguments."""
    from hybridrt.bench.progress import bar, step
    from hybridrt.loader import load_config, resolve_model_path

    if not 0 < restart_after < turns:
        raise ValueError(f"restart_after must be between 1 and turns - 1, got {restart_after}")
    vocab = load_config(resolve_model_path(model)).vocab_size
    msgs = _messages(vocab, turns, message_tokens)
    kw = dict(engine or {})
    pb = bar("restart", 3 + 2 * len(DAMAGES), unit="process", enabled=verbose)
    work = Path(tempfile.mkdtemp(prefix="hybridrt-restart-"))
    try:
        step(pb, "unrestarted")
        whole = _in_process(model, kw, str(work / "whole"), [], msgs, max_tokens)
        pb.update()
        step(pb, "turns before the restart")
        first = _in_process(model, kw, str(work / "restart"), [], msgs[:restart_after],
                            max_tokens)
        pb.update()
        for how in DAMAGES:
            shutil.copytree(work / "restart", work / how)
        step(pb, "turns after the restart")
        later = _in_process(model, kw, str(work / "restart"), first["history"],
                            msgs[restart_after:], max_tokens)
        pb.update()
        damaged = {}
        for how in DAMAGES:
            name = _damage(work / how, how)
            step(pb, f"after the restart, a {how} checkpoint")
            got = _in_process(model, kw, str(work / how), first["history"],
                              msgs[restart_after:], max_tokens)
            pb.update()
            damaged[how] = {"file": name, "log": got["log"],
                            "same_as_unrestarted": _same(got["rows"],
                                                         whole["rows"][restart_after:]),
                            "turn_after": _strip(got["rows"][0])}
    finally:
        pb.close()
        shutil.rmtree(work, ignore_errors=True)
    restarted = first["rows"] + later["rows"]
    report = {
        "model": str(model), "turns": turns, "restart_after": restart_after,
        "message_tokens": message_tokens, "max_tokens": max_tokens,
        "engine": {k: str(v) for k, v in kw.items()},
        "unrestarted": [_strip(r) for r in whole["rows"]],
        "restarted": [_strip(r) for r in restarted],
        "restarted_disk_hit_tokens": later["disk_hit_tokens"],
        "load_s": {"unrestarted": whole["load_s"], "after_restart": later["load_s"]},
        "same_as_unrestarted": _same(restarted, whole["rows"]),
        "damaged": damaged,
    }
    if verbose:
        print(table(report))
    return report


def _strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("token_ids", "logprobs")}


def table(report: dict) -> str:
    r = report["restart_after"]
    lines = [f"| turn | prompt | cached, unrestarted | cached, restarted after turn {r} | "
             "prefilled, unrestarted | prefilled, restarted |", "|" + " ---: |" * 6]
    for i, (u, s) in enumerate(zip(report["unrestarted"], report["restarted"]), 1):
        lines.append(f"| {i} | {u['prompt_tokens']} | {u['cached_tokens']} | "
                     f"{s['cached_tokens']} | {u['prefilled_tokens']} | "
                     f"{s['prefilled_tokens']} |")
    lines.append(f"answers bit for bit as unrestarted: {report['same_as_unrestarted']}; "
                 f"restored from disk: {report['restarted_disk_hit_tokens']} tokens")
    for how, d in report["damaged"].items():
        skipped = [x for x in d["log"] if "skipped" in x]
        lines.append(f"{how} checkpoint: turn {r + 1} cached "
                     f"{d['turn_after']['cached_tokens']}, answers bit for bit: "
                     f"{d['same_as_unrestarted']}; log: {skipped[0] if skipped else 'none'}")
    return "\n".join(lines)

