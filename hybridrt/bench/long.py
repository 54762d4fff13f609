"""``hybridrt bench long``: prefill of long prompts and decode deep into the context.

For each weight format (bf16, int4) and KV dtype (bf16, int8): the prefill of a prompt of each
of ``lengths`` tokens (tok/s, from the request's arrival to its first token, the prompt
chunked as the engine chunks it) and the decode after each of ``depths`` cached tokens (tok/s
over ``decode_tokens`` steps of one request; depth 0: a one-token prompt). One request per
distinct length serves both: its prefill, then its decode. ``attn %``: the share of the time in
the attention layers (the paged attention, or csrc/attn_decode.c), prefill and decode, the
decode's from a few more steps with the layers called one by one (the step program, one call
for all of them, hides it). Below the table: how many tokens of context the engine's cache
budget holds per request, alone and 4 at once, in bf16 and int8 KV. The default model is the
0.8B shape with random weights. With ``gguf`` llama.cpp's ``bench-long``
(``../shared/tools/llamacpp-bench``: ``llama-bench -p`` and ``-d``) runs on it after ours, its
rows beside them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from hybridrt import env
from hybridrt.sampling_params import SamplingParams

SHARE_STEPS = 4  # decode steps with the layers one by one, for the attention's share


class _AttentionTimer:
    """Seconds spent in the attention while installed: the backend's ``gated_attention`` and
    ``native.attn_decode`` (which the decode loop calls directly), the outermost call timed."""

    def __init__(self, backend) -> None:
        from hybridrt.kernels import native

        self.backend, self.native, self.seconds, self.depth = backend, native, 0.0, 0
        self.kernel = native.attn_decode
        backend.gated_attention = self._timed(backend.gated_attention)
        native.attn_decode = self._timed(self.kernel)

    def _timed(self, fn):
        def timed(*a, **k):
            self.depth += 1
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.seconds += time.perf_counter() - t
        return timed

    def remove(self) -> None:
        del self.backend.gated_attention
        self.native.attn_decode = self.kernel


def _one(llm, prompt_len: int, decode_tokens: int) -> dict:
    """One request of ``prompt_len`` tokens -> its prefill and decode figures."""
    eng = llm.engine
    backend = eng.runner.model.backend
    vocab = llm.config.vocab_size
    prompt = [(7 + 31 * i) % (vocab - 3) + 3 for i in range(max(prompt_len, 1))]
    sp = SamplingParams(temperature=0, max_tokens=decode_tokens + SHARE_STEPS + 1,
                        ignore_eos=True)
    timer = _AttentionTimer(backend)
    try:
        t0 = time.perf_counter()
        req = eng.get_request(eng.add_request(prompt, sp))
        while not req.output_token_ids:
            eng.step()
        prefill_s, prefill_attn = time.perf_counter() - t0, timer.seconds
        t1 = time.perf_counter()
        for _ in range(decode_tokens):
            eng.step()
        decode_s = (time.perf_counter() - t1) / decode_tokens
        program = getattr(backend, "_program", None)
        backend._program = lambda *a: None  # the layers one by one: the attention timed
        timer.seconds = 0.0
        t2 = time.perf_counter()
        for _ in range(SHARE_STEPS):
            eng.step()
        loop_s, loop_attn = (time.perf_counter() - t2) / SHARE_STEPS, timer.seconds / SHARE_STEPS
        if program is not None:
            del backend._program
    finally:
        timer.remove()
    while eng.has_unfinished_requests():
        eng.step()
    return {"prompt_len": len(prompt), "prefill_s": prefill_s,
            "prefill_tok_s": len(prompt) / prefill_s,
            "prefill_attn_share": prefill_attn / prefill_s,
            "decode_tok_s": 1 / decode_s, "decode_attn_share": loop_attn / loop_s}


def run(model: str | None = None, weights=("bf16", "int4"), kv_dtypes=("bf16", "int8"),
        lengths=(4096, 16384, 65536), depths=(0, 4096, 16384, 65536), decode_tokens: int = 8,
        threads: int = 2, gguf: str | None = None, json_path: str | None = None,
        progress: bool = True, **engine) -> dict:
    """The measurements (``report["rows"]``: one per weights x KV dtype x length), printed as a
    table; ``engine``: more ``LLM`` keyword arguments."""
    import torch
    from tqdm import tqdm

    from hybridrt import LLM
    from hybridrt.bench.throughput import make_random_08b
    from hybridrt.statecache.capacity import capacity_lines

    torch.set_num_threads(threads)
    todo = sorted(set(lengths) | set(depths))
    rows, capacity = [], None
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            model = str(make_random_08b(Path(tmp) / "rand08b"))
        bar = tqdm(total=len(weights) * len(kv_dtypes) * len(todo), desc="bench long",
                   disable=not progress)
        for w in weights:
            for kv in kv_dtypes:
                llm = LLM(model, dtype="bfloat16", quantization=None if w == "bf16" else w,
                          kv_cache_dtype=kv, threads=threads, tokenizer=None,
                          max_model_len=max(todo) + decode_tokens + SHARE_STEPS + 8,
                          max_num_seqs=1, enable_prefix_caching=False, **engine)
                if capacity is None:  # the tokens the engine's budget holds, bf16 / int8
                    extra = llm.model.num_attention_caches - len(
                        llm.config.full_attention_layers)
                    capacity = capacity_lines(llm.config, llm.engine.cache.sizing.total_bytes,
                                              (1, 4), num_extra_attention_layers=extra)
                for n in todo:
                    bar.set_postfix_str(f"{w} weights, {kv} KV, {n} tokens")
                    r = _one(llm, n, decode_tokens)
                    rows.append({"engine": "hybridrt", "weights": w, "kv": kv, "length": n,
                                 "prefill": n in lengths, "decode": n in depths, **r})
                    bar.update()
                del llm
        bar.close()
    report = {"threads": threads, "rows": rows, "capacity": capacity, "load": os.getloadavg()}
    if gguf is not None:
        report["llamacpp"] = llamacpp_long(gguf, threads, depths)
    print(table(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def llamacpp_long(gguf: str, threads: int, depths) -> list[dict]:
    """llama.cpp's ``bench-long`` on ``gguf`` -> its JSON lines (llama-bench's fields)."""
    tool = Path(__file__).resolve().parents[2] / ".." / "shared" / "tools" / "llamacpp-bench"
    tool = Path(env.read("HYBRIDRT_LLAMACPP_BENCH") or tool)
    out = subprocess.run([str(tool), "bench-long", str(gguf), str(threads),
                          ",".join(map(str, depths))], capture_output=True, text=True,
                         check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def table(report: dict) -> str:
    lines = [f"{'weights':<8} {'KV':<5} {'tokens':>7} {'prefill tok/s':>14} {'attn %':>7} "
             f"{'decode tok/s':>13} {'attn %':>7}"]
    for r in report["rows"]:
        pre = (f"{r['prefill_tok_s']:>14.1f} {100 * r['prefill_attn_share']:>7.1f}"
               if r["prefill"] else f"{'':>14} {'':>7}")
        dec = (f"{r['decode_tok_s']:>13.2f} {100 * r['decode_attn_share']:>7.1f}"
               if r["decode"] else f"{'':>13} {'':>7}")
        lines.append(f"{r['weights']:<8} {r['kv']:<5} {r['length']:>7} {pre} {dec}")
    lines += report.get("capacity", [])
    for r in report.get("llamacpp", []):
        what = (f"pp{r['n_prompt']}" if r.get("n_prompt") else f"tg{r.get('n_gen')}")
        lines.append(f"llama.cpp {r.get('type_k', '')} {what} at depth {r.get('n_depth', 0)}: "
                     f"{r['avg_ts']:.2f} tok/s")
    load = report.get("load")
    if load:
        lines.append(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
                     f"(figures taken under it)")
    return "\n".join(lines)
