"""int8 against bf16 weights, side by side in one process: decode at batch 1, prefill of one
512-token prompt, decode at 32 concurrent requests (the rows of ``hybridrt bench throughput``),
each measurement alternated between the two models for ``--rounds`` rounds; medians and ratios.

    python scripts/int8_speed.py /tmp/r08b --threads 2 --rounds 3

Without a checkpoint it writes a random-weight Qwen3.5-0.8B-shaped one (bf16) first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.throughput import _prompts, make_random_08b
from hybridrt.kernels import quant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model
    if path is None:
        tmp = tempfile.TemporaryDirectory(prefix="hybridrt-08b-")
        path = str(make_random_08b(tmp.name))
    print(f"load average before: {os.getloadavg()}", flush=True)
    c, n = args.concurrency, args.decode_tokens
    llms = {}
    for name, q in (("bf16", None), ("int8", "int8")):
        t = time.perf_counter()
        llms[name] = LLM(path, dtype="bfloat16", quantization=q, max_num_seqs=c,
                         max_model_len=args.prefill_len + n + 8,
                         max_num_batched_tokens=max(args.prefill_len, 512), cache_memory=0.2)
        print(f"{name}: loaded in {time.perf_counter() - t:.1f} s, weights "
              f"{quant.weight_bytes(llms[name].model) / 2**30:.2f} GiB", flush=True)
    vocab = llms["bf16"].config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for llm in llms.values():  # warm-up: first use of each shape
        llm.generate(_prompts(c, 16, vocab, 99), SamplingParams(temperature=0, max_tokens=2,
                                                               ignore_eos=True), use_tqdm=False)
    res: dict[str, dict[str, list[float]]] = {k: {} for k in llms}
    for r in range(args.rounds):
        for name, llm in llms.items():
            rec = res[name]
            (o,) = llm.generate(_prompts(1, 16, vocab, 200 + r), sp, use_tqdm=False)
            rec.setdefault("decode_b1_tok_s", []).append(o.metrics["decode_tokens_per_s"])
            t = time.perf_counter()
            llm.generate(_prompts(1, args.prefill_len, vocab, 100 + r), one, use_tqdm=False)
            rec.setdefault(f"prefill{args.prefill_len}_tok_s", []).append(
                args.prefill_len / (time.perf_counter() - t))
            outs = llm.generate(_prompts(c, 16, vocab, 300 + r), sp, use_tqdm=False)
            rec.setdefault(f"decode_b{c}_tok_s", []).append(
                sum(o.metrics["decode_tokens_per_s"] for o in outs))
        print(f"round {r + 1}: " + "  ".join(
            f"{name} {k} {v[-1]:.2f}" for name in res for k, v in res[name].items()), flush=True)
    print(f"load average after: {os.getloadavg()}")
    print(f"{'metric (median of ' + str(args.rounds) + ')':<26}{'bf16':>10}{'int8':>10}"
          f"{'int8/bf16':>11}")
    for k in res["bf16"]:
        a, b = statistics.median(res["bf16"][k]), statistics.median(res["int8"][k])
        print(f"{k:<26}{a:>10.2f}{b:>10.2f}{b / a:>10.2f}x")


if __name__ == "__main__":
    main()
