"""``hybridrt bench serve``: a bounded load test of ``hybridrt serve`` over loopback.

Each run starts ``hybridrt serve`` as a subprocess on a free 127.0.0.1 port and runs
``conversations`` chat clients at once; each client holds one conversation of ``turns``
turns, resending the whole history every turn as chat clients do, streaming each answer
(greedy, ``max_tokens`` tokens, EOS ignored, so every run generates the same tokens). Two
runs: prefix caching on and off (``--no-prefix-caching``); with ``replicas`` (e.g. [1, 2])
instead, one run per count of Ray Serve replicas (``--replicas N``, prefix caching on) with
prefix-aware routing, and for more than one replica another with Ray Serve's power-of-two
router. Per run: requests/s, output tokens/s, time to first token and inter-token latency
percentiles (at the client, first streamed piece of text / gaps between streamed pieces), the
prompt tokens reused vs prefilled (the server's ``/metrics``, summed over replicas) and the
hit rate (cached / prompt tokens, from each answer's usage). A turn not started within
``time_limit`` seconds of the run's start is skipped and counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

SYSTEM = ("You answer questions about the Python standard library in one or two sentences, "
          "naming the module and the function, and you say so when you are not sure. ")
QUESTIONS = ["What does json.dumps do?", "Which module provides deque?",
             "What is the signature of os.path.join?", "What does re.sub return?",
             "How do I read a file line by line?", "What does itertools.chain do?",
             "What is functools.lru_cache for?", "What does shutil.copy do?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def _metrics(client, base: str) -> dict[str, float]:
    """Each metric's value, summed over its labels (replicas, finish reasons); the router's
    decisions also one by one (``name|decision``)."""
    out: dict[str, float] = {}
    for line in client.get(f"{base}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            sample, value = line.rsplit(" ", 1)
            name = sample.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
            if 'decision="' in sample:
                out[f"{name}|{sample.split(chr(34))[1]}"] = float(value)
    return out


async def _conversation(client, base: str, c: int, turns: int, max_tokens: int,
                        deadline: float, rec: dict, pbar) -> None:
    messages = [{"role": "system", "content": SYSTEM * 3}]
    for t in range(turns):
        if time.perf_counter() > deadline:
            rec["skipped"] += 1
            pbar.update()
            continue
        messages.append({"role": "user", "content": QUESTIONS[(c + t) % len(QUESTIONS)]})
        body = {"model": rec["model"], "messages": messages, "stream": True,
                "temperature": 0, "max_tokens": max_tokens, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        last, answer = None, []
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec["errors"] += 1
                pbar.update(turns - t)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    rec["tokens"] += usage["completion_tokens"]
                    rec["prompt_tokens"] += usage["prompt_tokens"]
                    rec["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
                if not chunk.get("choices"):
                    continue
                delta = chunk["choices"][0]["delta"]
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if not piece:
                    continue
                now = time.perf_counter()
                if last is None:
                    rec["ttft"].append(now - t0)
                else:
                    rec["itl"].append(now - last)
                last = now
                answer.append(piece)
        rec["requests"] += 1
        pbar.update()
        messages.append({"role": "assistant", "content": "".join(answer)})


async def _load(base: str, model: str, conversations: int, turns: int, max_tokens: int,
                time_limit: float, pbar) -> dict:
    import httpx

    rec = {"model": model, "ttft": [], "itl": [], "requests": 0, "tokens": 0, "skipped": 0,
           "errors": 0, "prompt_tokens": 0, "cached_tokens": 0}
    limits = httpx.Limits(max_connections=conversations + 4)
    async with httpx.AsyncClient(timeout=time_limit + 60, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(_conversation(client, base, c, turns, max_tokens,
                                             t0 + time_limit, rec, pbar)
                               for c in range(conversations)))
        rec["seconds"] = time.perf_counter() - t0
    return rec


def _wait_healthy(client, base: str, proc, log, seconds: float = 600.0) -> None:
    """Until /health says "ok" (every replica up: a Ray instance and its replicas take a
    while to start); RuntimeError if the server exits or takes longer than ``seconds``."""
    import httpx

    deadline = time.perf_counter() + seconds
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"hybridrt serve exited: {log.read()[-2000:]}")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"hybridrt serve was not healthy within {seconds:g} s")
        try:
            r = client.get(f"{base}/health")
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.2)


def _one_run(model: str | None, reuse: bool, conversations: int, turns: int,
             max_tokens: int, time_limit: float, threads: int | None,
             replicas: int | None = None, router: str = "prefix",
             router_imbalance: int | None = None, engine_flags: Sequence[str] = (),
             pbar=None) -> dict:
    import httpx

    from hybridrt.bench import progress

    pbar = pbar if pbar is not None else progress.silent()
    what = (f"{replicas} replica(s), {router} router" if replicas is not None
            else f"prefix reuse {'on' if reuse else 'off'}")
    progress.step(pbar, f"{what}: starting the server")

    port = _free_port()
    cmd = [sys.executable, "-m", "hybridrt", "serve", "--port", str(port), "--log-level",
           "warning", "--prefix-caching" if reuse else "--no-prefix-caching", "--max-num-seqs",
           str(conversations), *engine_flags]
    if model is not None:
        cmd.insert(4, model)  # after "serve"
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if replicas is not None:
        cmd += ["--replicas", str(replicas), "--router", router]
        if router == "prefix" and router_imbalance is not None:
            cmd += ["--router-imbalance", str(router_imbalance)]
    base = f"http://127.0.0.1:{port}"
    # the server's output goes to a file: a pipe nobody reads would fill and stall Ray's logs
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            with httpx.Client(timeout=30) as client:
                _wait_healthy(client, base, proc, log)
                name = client.get(f"{base}/v1/models").json()["data"][0]["id"]
                before = _metrics(client, base)
                progress.step(pbar, f"{what}: requests")
                rec = asyncio.run(_load(base, name, conversations, turns, max_tokens,
                                        time_limit, pbar))
                after = _metrics(client, base)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=90)  # Ray's shutdown takes a while
            except subprocess.TimeoutExpired:
                proc.kill()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    ms = [round(1000 * v, 1) if v is not None else None for v in
          (_pct(rec["ttft"], 50), _pct(rec["ttft"], 90), _pct(rec["ttft"], 99),
           _pct(rec["itl"], 50), _pct(rec["itl"], 90), _pct(rec["itl"], 99))]
    return {"replicas": replicas, "router": router if replicas else None,
            "prefix_reuse": reuse, "requests": rec["requests"],
            "skipped": rec["skipped"], "errors": rec["errors"],
            "seconds": round(rec["seconds"], 2),
            "requests_per_s": round(rec["requests"] / rec["seconds"], 3),
            "output_tokens_per_s": round(rec["tokens"] / rec["seconds"], 1),
            "ttft_ms_p50": ms[0], "ttft_ms_p90": ms[1], "ttft_ms_p99": ms[2],
            "itl_ms_p50": ms[3], "itl_ms_p90": ms[4], "itl_ms_p99": ms[5],
            "hit_rate": round(rec["cached_tokens"] / max(1, rec["prompt_tokens"]), 4),
            "prompt_tokens": int(delta.get("hybridrt_prompt_tokens_total", 0)),
            "reused_tokens": int(delta.get("hybridrt_prefix_reused_tokens_total", 0)),
            "prefilled_tokens": int(delta.get("hybridrt_prefill_tokens_total", 0)),
            "server_exit": proc.returncode,  # 0: it stopped cleanly on SIGTERM
            # the prefix-aware router's decisions (hybridrt.prefix_routing.rank)
            **{f"routed_{d}": int(delta.get(f"hybridrt_router_decisions_total|{d}", 0))
               for d in ("prefix", "overloaded", "least_loaded")}}


COLUMNS = ["prefix_reuse", "requests", "skipped", "seconds", "requests_per_s",
           "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50",
           "itl_ms_p90", "itl_ms_p99", "hit_rate", "prompt_tokens", "reused_tokens",
           "prefilled_tokens"]
REPLICA_COLUMNS = ["replicas", "router", "requests", "errors", "seconds", "requests_per_s",
                   "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50",
                   "hit_rate", "prompt_tokens", "prefilled_tokens", "routed_prefix",
                   "routed_overloaded", "routed_least_loaded"]


def table(rows: list[dict]) -> str:
    columns = REPLICA_COLUMNS if rows and rows[0].get("replicas") else COLUMNS
    lines = ["| " + " | ".join(columns) + " |", "|" + " ---: |" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join("on" if r[c] is True else "off" if r[c] is False
                                       else str(r[c]) for c in columns) + " |")
    return "\n".join(lines)


def run(model: str | None = None, conversations: int = 8, turns: int = 4, max_tokens: int = 32,
        time_limit: float = 300.0, threads: int | None = None,
        json_path: str | os.PathLike | None = None,
        replicas: list[int] | None = None, router_imbalance: int | None = None,
        engine_flags: Sequence[str] = ()) -> dict:
    """Both runs (reuse on, then off), or with ``replicas`` a run per replica count (and
    per router beyond one replica) -> the report; prints the table. ``engine_flags``: the
    command line's model options but those the benchmark sets itself, as serve's flags.
    A progress bar counts the requests of every run."""
    from hybridrt.bench import progress

    runs = ([(n, router) for n in replicas for router in
             (("prefix", "pow2") if n > 1 else ("prefix",))] if replicas else [])
    pbar = progress.bar("serve", (len(runs) or 2) * conversations * turns, unit="request")
    if replicas:
        rows = [_one_run(model, True, conversations, turns, max_tokens, time_limit, threads,
                         n, router, router_imbalance, engine_flags, pbar) for n, router in runs]
    else:
        rows = [_one_run(model, reuse, conversations, turns, max_tokens, time_limit, threads,
                         engine_flags=engine_flags, pbar=pbar) for reuse in (True, False)]
    pbar.close()
    report = {"model": model or "demo", "conversations": conversations, "turns": turns,
              "max_tokens": max_tokens, "time_limit": time_limit, "threads": threads,
              "replicas": replicas, "router_imbalance": router_imbalance, "runs": rows}
    print(table(rows))
    if json_path is not None:
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    return report
