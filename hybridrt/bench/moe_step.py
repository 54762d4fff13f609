"""Decode speed of an MoE model's steps three ways, in one process with the rounds alternated
(so their ratios come from the same minutes of the machine)::

    python -m hybridrt.bench.moe_step MODEL --threads 2 --rounds 3 --tokens 32

- ``program``: the CPU backend's step program (kernels/step.py, kernels/moe_step.py): the
  layers compiled, one return to Python per MoE layer for its routing;
- ``loop``: the backend's decode loop in Python (``HYBRIDRT_STEP_PROGRAM=0``);
- ``layers``: the model's own layer loop (the modules, the block's ``sparse_moe``).

Each run decodes ``tokens`` greedy tokens for ``batch`` prompts of ``prompt_len`` tokens; its
tok/s is the sum of the requests' decode rates (``decode_tokens_per_s``, first token excluded).
The report has the median per mode, each mode's ratio to ``layers``, whether the three gave
the same tokens, and the load average before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics

MODES = ("program", "loop", "layers")


def run(model: str, batch: int = 1, tokens: int = 32, rounds: int = 3, prompt_len: int = 8,
        threads: int | None = None, quantization: str | None = None,
        modes: tuple[str, ...] = MODES) -> dict:
    """The three modes' decode tok/s on ``model`` (bf16, or quantized at load) -> the report."""
    from hybridrt.llm import LLM
    from hybridrt.sampling_params import SamplingParams

    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise ValueError(f"unknown modes {unknown}: choose from {list(MODES)}")
    load = [os.getloadavg()[0]]
    llm = LLM(model, dtype="bfloat16", quantization=quantization, tokenizer=None,
              threads=threads, max_num_seqs=batch, max_model_len=prompt_len + tokens + 8,
              cache_memory=256 << 20, enable_prefix_caching=False)
    be = llm.engine.runner.model.backend
    fast = getattr(be, "fast", None)
    if fast is None:
        raise ValueError("the CPU backend's decode loop does not run this model (it needs the "
                         "compiled CPU kernels and a bf16 or quantized model)")
    options = be.options
    vocab = llm.config.vocab_size
    prompts = [[(7 + 13 * i + 31 * j) % vocab for j in range(prompt_len)] for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    outputs: dict[str, list] = {}
    for r in range(rounds + 1):  # round 0: warm-up (programs built, pages touched)
        for m in modes:
            be.fast = None if m == "layers" else fast
            be.options = dataclasses.replace(options, step_program=m == "program")
            outs = llm.generate(prompts, sp, use_tqdm=False)
            outputs[m] = [o.outputs[0].token_ids for o in outs]
            if r:
                rates[m].append(sum(o.metrics["decode_tokens_per_s"] for o in outs))
    be.fast, be.options = fast, options
    load.append(os.getloadavg()[0])
    tok_s = {m: statistics.median(v) for m, v in rates.items()}
    base = tok_s.get("layers")
    return {"model": str(model), "batch": batch, "tokens": tokens, "rounds": rounds,
            "threads": threads, "quantization": quantization, "tok_s": tok_s,
            "runs": rates, "x_layers": {m: v / base for m, v in tok_s.items()} if base else {},
            "same_tokens": len({json.dumps(v) for v in outputs.values()}) == 1,
            "load_average": load}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hybridrt.bench.moe_step",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="checkpoint directory (e.g. hybridrt.bench.moe_shape's)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens a run decodes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--quantization", default=None, choices=["int8", "int4"],
                    help="quantize a bf16 checkpoint at load")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of " +
                    ", ".join(MODES))
    args = ap.parse_args(argv)
    report = run(args.model, args.batch, args.tokens, args.rounds, args.prompt_len,
                 args.threads, args.quantization, tuple(args.modes.split(",")))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
