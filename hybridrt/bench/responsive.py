"""``hybridrt bench responsive``: does a long prefill stall the others' decode?

One request decodes (a short prompt, many tokens); once its tokens flow, a second request
arrives with a long prompt, which the engine prefills in chunks of the step budget
(``max_num_batched_tokens``) while the first keeps decoding. Measured over the steps of that
prefill: the first request's inter-token gaps (max, p99, median), the tokens it got against
the steps taken, and for scale its gap alone before the long prompt arrived. With chunked
prefill a gap stays one step of at most ``budget`` tokens; without it the first request would
wait for the whole prompt. The default model is the 0.8B shape with random weights.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from hybridrt.sampling_params import SamplingParams


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def measure(llm, prompt_len: int, warm_tokens: int = 4) -> dict:
    """The two requests on ``llm``'s engine (it must allow 2 sequences) -> the figures:
    ``steps`` of the long prefill, ``decode_tokens`` the first request got during them,
    ``gaps_s`` (its inter-token gaps there), ``alone_gap_s`` (median gap before)."""
    eng = llm.engine
    vocab = llm.config.vocab_size
    long_prompt = [(7 + 31 * i) % (vocab - 3) + 3 for i in range(prompt_len)]
    decode = SamplingParams(temperature=0, max_tokens=1 << 20, ignore_eos=True)
    first = eng.get_request(eng.add_request([5, 6, 7], decode))
    stamps = []
    while len(first.output_token_ids) < warm_tokens + 1:
        eng.step()
        stamps.append((time.perf_counter(), len(first.output_token_ids)))
    alone = [b[0] - a[0] for a, b in zip(stamps[1:], stamps[2:]) if b[1] > a[1]]
    second = eng.get_request(eng.add_request(
        long_prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)))
    last, n0 = time.perf_counter(), len(first.output_token_ids)
    gaps, steps, chunks = [], 0, []
    while not second.output_token_ids:
        before = second.num_computed_tokens
        had = len(first.output_token_ids)
        eng.step()
        steps += 1
        chunks.append(second.num_computed_tokens - before)
        if len(first.output_token_ids) > had:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    got = len(first.output_token_ids) - n0
    eng.abort_request(first.request_id)
    while eng.has_unfinished_requests():
        eng.step()
    return {"prompt_len": prompt_len, "steps": steps, "decode_tokens": got,
            "largest_chunk": max(chunks), "gaps_s": gaps,
            "gap_max_s": max(gaps, default=0.0), "gap_p99_s": _quantile(gaps, 0.99),
            "gap_median_s": _quantile(gaps, 0.5),
            "alone_gap_s": _quantile(alone, 0.5)}


def run(model: str | None = None, prompt_len: int = 32768, budget: int = 2048,
        threads: int = 2, kv: str = "bf16", weights: str = "bf16",
        json_path: str | None = None, **engine) -> dict:
    """One measurement, printed; ``engine``: more ``LLM`` keyword arguments."""
    import torch

    from hybridrt import LLM
    from hybridrt.bench.throughput import make_random_08b

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            model = str(make_random_08b(Path(tmp) / "rand08b"))
        engine.setdefault("max_model_len", prompt_len + 64)
        llm = LLM(model, dtype="bfloat16", quantization=None if weights == "bf16" else weights,
                  kv_cache_dtype=kv, threads=threads, tokenizer=None, max_num_seqs=2,
                  max_num_batched_tokens=budget, enable_prefix_caching=False, **engine)
        report = measure(llm, prompt_len)
        del llm
    report.update(threads=threads, budget=budget, kv=kv, weights=weights,
                  load=os.getloadavg())
    print(text(report))
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return report


def text(r: dict) -> str:
    ms = 1e3
    lines = [
        f"long prompt {r['prompt_len']} tokens, step budget {r['budget']} tokens "
        f"({r['weights']} weights, {r['kv']} KV, {r['threads']} threads)",
        f"its prefill: {r['steps']} steps (largest chunk {r['largest_chunk']} tokens); the "
        f"decoding request got {r['decode_tokens']} tokens in them",
        f"inter-token gap while it prefills: max {r['gap_max_s'] * ms:.1f} ms, p99 "
        f"{r['gap_p99_s'] * ms:.1f} ms, median {r['gap_median_s'] * ms:.1f} ms; alone before "
        f"it: {r['alone_gap_s'] * ms:.1f} ms",
    ]
    load = r.get("load")
    if load:
        lines.append(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
                     f"(figures taken under it)")
    return "\n".join(lines)
