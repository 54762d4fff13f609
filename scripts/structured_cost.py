"""The cost of structured outputs (docs/structured_outputs.md): mean decode-step time with a
JSON-schema constraint on every request vs none, batch 1 and 32, rounds alternated in one
process; and a typical schema's compile time, cold (the first compile also reads the
vocabulary into xgrammar) and cached.

    python scripts/structured_cost.py CHECKPOINT [--rounds 3] [--threads 1 --cpu-time]

CHECKPOINT: e.g. the 0.8B shape with random weights (hybridrt.bench.throughput's
make_random_08b) with a tokenizer copied in; decode steps are timed by the engine itself
(``LLMEngine.step_costs``, kind "decode").
"""

from __future__ import annotations

import argparse
import json
import time

from hybridrt import LLM, SamplingParams
from hybridrt.sampling_params import StructuredOutputsParams
from hybridrt.specdec.stats import StepCosts

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string",
                                                         "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
    "role": {"enum": ["admin", "user", "guest"]}, "score": {"type": "number"},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "email", "tags", "address", "role", "score", "active"]}


def decode_step_ms(llm: LLM, batch: int, constrained: bool, tokens: int,
                   clock=time.perf_counter) -> tuple[float, int]:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=so) for i in range(batch)]
    prompts = [[100 + (7 * i + j) % 5000 for j in range(16)] for i in range(batch)]
    llm.engine.step_costs = StepCosts(clock=clock)
    llm.generate(prompts, params, use_tqdm=False)
    c = llm.engine.step_costs
    return 1e3 * c.mean("decode"), c.counts["decode"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps in this process's CPU time (a busy machine; use --threads 1)")
    a = ap.parse_args()
    clock = time.process_time if a.cpu_time else time.perf_counter
    llm = LLM(a.model, threads=a.threads, max_model_len=256, max_num_seqs=32)
    so = llm.engine.structured_outputs
    t0 = time.perf_counter()
    so.compile(StructuredOutputsParams(json=SCHEMA))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    so.compile(StructuredOutputsParams(json={**SCHEMA, "title": "another"}))
    cold_schema = time.perf_counter() - t0
    t0 = time.perf_counter()
    so.compile(StructuredOutputsParams(json=SCHEMA))
    cached = time.perf_counter() - t0
    print(json.dumps({"compile_first_s": cold, "compile_new_schema_s": cold_schema,
                      "compile_cached_s": cached}))
    for batch in (1, 32):
        decode_step_ms(llm, batch, True, 4)  # warm
        res = {False: [], True: []}
        for _ in range(a.rounds):
            for constrained in (False, True):
                res[constrained].append(decode_step_ms(llm, batch, constrained, a.tokens,
                                                      clock))
        off = sorted(ms for ms, _ in res[False])[len(res[False]) // 2]
        on = sorted(ms for ms, _ in res[True])[len(res[True]) // 2]
        print(json.dumps({"batch": batch, "decode_step_ms_off": off, "decode_step_ms_on": on,
                          "ratio": on / off, "rounds": res}))


if __name__ == "__main__":
    main()
