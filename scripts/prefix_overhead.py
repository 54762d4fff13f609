"""Where the prefix cache's overhead goes when nothing is shared (docs/prefix_cache.md, (c)):
one engine, prefix caching on or off, one cold pass of ``bench prefix``'s disjoint workload
(64 random 128-token prompts, 16 new tokens each) under cProfile in this process's CPU time,
one thread; prints the total and the 25 functions with the most time of their own.

    python scripts/prefix_overhead.py CHECKPOINT on|off

Run it with on and off one after the other: the functions the cache adds (the GDN rounds cut
at checkpoints, the state copies into checkpoint slots) show as extra calls of the same rows.
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.prefix import disjoint_prompts


def main() -> None:
    model, mode = sys.argv[1], sys.argv[2]
    if mode not in ("on", "off"):
        raise SystemExit("usage: prefix_overhead.py CHECKPOINT on|off")
    torch.set_num_threads(1)
    # bench prefix's context length and budget for its default workloads
    llm = LLM(model, enable_prefix_caching=mode == "on", max_model_len=2138, max_num_seqs=64,
              cache_memory="4GiB", threads=1)
    prompts = disjoint_prompts(llm.config.vocab_size, 64, 128)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng = llm.engine
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    for p in prompts:
        eng.add_request(p, params)
    while eng.has_unfinished_requests():
        eng.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
