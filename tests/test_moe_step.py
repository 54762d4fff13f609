"""An MoE model's decode steps on the CPU backend's own loop and step programs
(kernels/moe_step.py, csrc/step.c OP_MOE): the bits of the model's layer loop (the block's
``sparse_moe``), for bf16, int8 and 4-bit experts, decode steps of 1-3 sequences and
verification steps of k = 2 drafts."""

from __future__ import annotations

import pytest
import torch
from helpers import output_bytes

from hybridrt import LLM, SamplingParams
from hybridrt.bench import moe_step as moe_step_bench
from hybridrt.bench.moe_fixtures import tiny_moe_config, write_moe_checkpoint
from hybridrt.kernels import moe as moe_kernels
from hybridrt.kernels import native
from hybridrt.kernels.step import StepProgram

pytestmark = [pytest.mark.usefixtures("one_thread_module"),  # tests/conftest.py
              pytest.mark.skipif(native.load() is None or not native.half_gemm_available(),
                                 reason="needs the compiled CPU kernels")]

# whole panels of 16 rows in every product (the 4-bit format's: every layer's projections
# merged, as in test_step_program.py); expert FFN narrower than the shared one, top 3 of 8
CFG = tiny_moe_config(vocab_size=131, linear_num_key_heads=4, linear_num_value_heads=16,
                      linear_key_head_dim=8, head_dim=16, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3)
PROMPTS = [[3, 4, 5], list(range(7, 30)), [9, 1]]
RUN = StepProgram.run


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_moe_checkpoint(tmp_path_factory.mktemp("moestep"), CFG, seed=3,
                                dtype=torch.bfloat16)


def _run(ckpt, quantization, mode: str, monkeypatch):
    """Greedy outputs (token ids and logprob bytes) at k = 0 and k = 2 with the decode steps
    on the step programs (``program``), the backend's loop in Python (``loop``) or the
    model's layers (``model``) -> (outputs, the shapes the programs ran)."""
    monkeypatch.setenv("HYBRIDRT_STEP_PROGRAM", "1" if mode == "program" else "0")
    ran = set()  # the (rows, tokens each) of the programs that ran

    def recording(self, *args):
        ran.add((self.rows, self.L))
        return RUN(self, *args)

    monkeypatch.setattr(StepProgram, "run", recording)
    llm = LLM(ckpt, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=3,
              cache_memory=8 << 20, quantization=quantization, speculative_tokens=2)
    be = llm.engine.runner.model.backend
    assert be.fast is not None
    assert sum(f.moe is not None for f in be.fast) == CFG["num_hidden_layers"]
    if mode == "model":
        be.fast = None
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    keys = [[output_bytes(o) for o in llm.generate(PROMPTS, sp, use_tqdm=False,
                                                   speculative_tokens=k)] for k in (0, 2)]
    return keys, ran


@pytest.mark.parametrize("weights", ["bf16", "bf16-fma", "int8", "int4"])
def test_program_and_loop_give_the_models_bits(ckpt, weights, monkeypatch):
    """Greedy tokens and logprob bytes equal on the three paths; the programs ran for decode
    steps of 3 rows and verification steps."""
    if weights == "bf16-fma":
        monkeypatch.setenv("HYBRIDRT_HALF_PATH", "fma")
    elif weights == "bf16" and "bf16dot" not in native.half_paths():
        pytest.skip("no AVX512-BF16 on this CPU")
    quantization = weights if weights.startswith("int") else None
    model, _ = _run(ckpt, quantization, "model", monkeypatch)
    loop, none = _run(ckpt, quantization, "loop", monkeypatch)
    program, programs = _run(ckpt, quantization, "program", monkeypatch)
    assert none == set()
    assert loop == model
    assert program == model
    assert (3, 1) in programs and any(L > 1 for _, L in programs)


def test_a_program_routes_each_moe_layer_once_a_step(ckpt, monkeypatch):
    """A decode step of one sequence through a program: one routing per MoE layer, of one
    row, over the layer's router logits (those of the model's block for that token)."""
    monkeypatch.setenv("HYBRIDRT_STEP_PROGRAM", "1")
    llm = LLM(ckpt, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=1,
              cache_memory=8 << 20, quantization="int4")
    calls = []
    real = moe_kernels.route

    def recording(logits, k):
        calls.append((tuple(logits.shape), k))
        return real(logits, k)

    monkeypatch.setattr(moe_kernels, "route", recording)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([[3, 4, 5]], sp, use_tqdm=False)
    be = llm.engine.runner.model.backend
    (program,) = [p for p in be.programs.values() if p is not None]
    layers = CFG["num_hidden_layers"]
    assert len(program.routes) == layers
    # the prompt (the model's layers), then two decode steps on the program
    decode = calls[layers:]
    assert decode == [((1, CFG["num_experts"]), CFG["num_experts_per_tok"])] * (2 * layers)


def test_the_bench_compares_the_three_paths(ckpt):
    """``python -m hybridrt.bench.moe_step`` on the tiny checkpoint: a rate per path, the same
    tokens on the three."""
    report = moe_step_bench.run(str(ckpt), tokens=4, rounds=1, quantization="int4")
    assert set(report["tok_s"]) == set(moe_step_bench.MODES)
    assert all(v > 0 for v in report["tok_s"].values())
    assert report["same_tokens"] and report["x_layers"]["layers"] == 1.0
    with pytest.raises(ValueError, match="unknown modes"):
        moe_step_bench.run(str(ckpt), modes=("compiled",))
