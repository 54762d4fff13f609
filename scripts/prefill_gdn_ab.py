"""CPU prefill with the GDN prompt chunks through the compiled layer call (the CPU backend's
``gdn_prompts``) against the torch chunked form (the reference backend's), alternated in one
process over one engine: prefill tok/s of one prompt per length, medians of ``--rounds``
rounds, and the first token and its logprob under each.

    python scripts/prefill_gdn_ab.py /tmp/r08b --lens 512,2048 --threads 2 --rounds 3

Without a checkpoint it writes a random-weight Qwen3.5-0.8B-shaped one (bf16) first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from hybridrt import LLM, SamplingParams
from hybridrt.bench.throughput import _prompts, make_random_08b
from hybridrt.kernels.backend import CPUBackend, ReferenceBackend


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--lens", default="512,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lens = [int(n) for n in args.lens.split(",")]
    tmp = None
    if args.model is None:
        tmp = tempfile.TemporaryDirectory()
        args.model = str(make_random_08b(tmp.name))
    llm = LLM(args.model, dtype="bfloat16", max_model_len=max(lens) + 8, max_num_seqs=1,
              threads=args.threads, max_num_batched_tokens=max(lens), tokenizer=None)
    compiled = CPUBackend.gdn_prompts
    paths = {"chunked torch": ReferenceBackend.gdn_prompts, "compiled": compiled}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=1)
    try:
        for n in lens:
            prompt = _prompts(1, n, llm.config.vocab_size, n)[0]
            rates: dict[str, list[float]] = {name: [] for name in paths}
            first = {}
            for r in range(args.rounds + 1):  # round 0 warms up
                for name, fn in paths.items():
                    CPUBackend.gdn_prompts = fn
                    t = time.perf_counter()
                    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                    if r:
                        rates[name].append(n / (time.perf_counter() - t))
                    first[name] = (out.token_ids[0], round(out.logprobs[0][out.token_ids[0]], 4))
            old, new = (statistics.median(rates[name]) for name in paths)
            print(f"prefill {n}: chunked torch {old:.1f} tok/s, compiled {new:.1f} tok/s, "
                  f"ratio {new / old:.3f}; first token (id, logprob) {first}", flush=True)
    finally:
        CPUBackend.gdn_prompts = compiled
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    main()
