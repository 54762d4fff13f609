"""What one glibc malloc arena (``hybridrt serve``'s setting, docs/server.md) costs the engine
when a large prompt is tokenized beside it.

    python scripts/arena_contention.py [--rounds 4] [--tokens 400]

Each run is a fresh process with ``MALLOC_ARENA_MAX`` = 16 (glibc's default on 2 cores, 8 per
core) or 1, in the order 16, 1, 1, 16, ... : the demo model in bf16 on one thread decodes 8
requests of ``--tokens`` greedy tokens, first alone ("quiet"), then beside a thread that
tokenizes a 900 KB text non-stop ("busy"; the tokenizer releases the GIL and allocates
through malloc). Prints each run and the medians per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = r"""
import json, sys, threading, time
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
llm = LLM(dtype="bfloat16", max_model_len=512, threads=1, max_num_seqs=8)
tok = llm.tokenizer.backend_tokenizer
text = "the quick brown fox jumps over the lazy dog. " * 20000
stop, encodes = False, 0

def churn():
    global encodes
    while not stop:
        tok.encode_batch([text], add_special_tokens=False)
        encodes += 1

prompts = [[10 + i + j for i in range(16)] for j in range(8)]
sp = SamplingParams(temperature=0, max_tokens=int(sys.argv[1]), ignore_eos=True)
llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
             use_tqdm=False)

def timed():
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t

quiet = timed()
thread = threading.Thread(target=churn)
thread.start()
busy = timed()
stop = True
thread.join()
print(json.dumps({"quiet_s": quiet, "busy_s": busy, "encodes": encodes}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=400)
    args = ap.parse_args()
    rows = []
    for r in range(args.rounds):
        for arenas in ("16", "1") if r % 2 == 0 else ("1", "16"):
            out = subprocess.run([sys.executable, "-c", PROBE, str(args.tokens)],
                                 capture_output=True, text=True, check=True,
                                 env={**os.environ, "MALLOC_ARENA_MAX": arenas})
            row = {"arenas": arenas, **json.loads(out.stdout.strip().splitlines()[-1])}
            print(row, flush=True)
            rows.append(row)
    for arenas in ("16", "1"):
        mine = [r for r in rows if r["arenas"] == arenas]
        print(f"MALLOC_ARENA_MAX={arenas}: quiet median "
              f"{statistics.median(r['quiet_s'] for r in mine):.2f} s, busy median "
              f"{statistics.median(r['busy_s'] for r in mine):.2f} s")


if __name__ == "__main__":
    main()
