"""kernels/step.py: a decode step's layers as one compiled call give the bits of the backend's
decode loop in Python (the same kernels in the same order), for every kind of weight, for
decode and verification steps, with and without the states kept after each token."""

from __future__ import annotations

import pytest
import torch
from helpers import output_bytes

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.kernels import native

pytestmark = pytest.mark.skipif(native.load() is None or not native.half_gemm_available(),
                                reason="needs the compiled CPU kernels")

# projections of whole panels of 16 rows (the 4-bit format's), every layer's merged
CONFIG = dict(vocab_size=131, linear_num_key_heads=4, linear_num_value_heads=16,
              linear_key_head_dim=8, head_dim=16, intermediate_size=96)
PROMPTS = [[3, 4, 5], list(range(7, 30)), [9, 1]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("step"), tiny_text_config(**CONFIG),
                                   seed=3, dtype=torch.bfloat16)


def _run(ckpt, quantization, program: bool, monkeypatch, prompts=PROMPTS):
    monkeypatch.setenv("HYBRIDRT_STEP_PROGRAM", "1" if program else "0")
    llm = LLM(ckpt, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=3,
              cache_memory=8 << 20, quantization=quantization, speculative_tokens=2)
    be = llm.engine.runner.model.backend
    assert be.fast is not None
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    keys = [[output_bytes(o) for o in llm.generate(prompts, sp, use_tqdm=False,
                                                   speculative_tokens=k)] for k in (0, 2)]
    return keys, dict(be.programs)


@pytest.mark.parametrize("weights", ["bf16", "bf16-fma", "int8", "int4"])
def test_program_gives_the_loops_bits(ckpt, weights, monkeypatch):
    """Greedy tokens and logprob bytes with the step programs equal those of the loop in
    Python, at k = 0 (decode steps of 1-3 sequences) and k = 2 (verification steps of 3
    tokens, the states after each kept); the programs ran, for every shape but the bf16
    verification of 9 rows (past the bf16 GEMV's 8: the loop's GEMM, in Python)."""
    if weights == "bf16-fma":
        monkeypatch.setenv("HYBRIDRT_HALF_PATH", "fma")
    elif weights == "bf16" and "bf16dot" not in native.half_paths():
        pytest.skip("no AVX512-BF16 on this CPU")
    quantization = weights if weights.startswith("int") else None
    on, programs = _run(ckpt, quantization, True, monkeypatch)
    off, none = _run(ckpt, quantization, False, monkeypatch)
    assert on == off
    assert none == {}
    built = {(rows, L) for (rows, L, _), p in programs.items() if p is not None}
    assert (3, 1) in built
    if quantization:
        assert (9, 3) in built
    else:
        assert (9, 3) not in built and any(
            p is None for (rows, *_), p in programs.items() if rows == 9)


def test_a_failed_operation_is_an_error_naming_it(ckpt, monkeypatch):
    """An operation that fails (here: an unknown code) stops the step with an error naming
    it, not a wrong result."""
    monkeypatch.setenv("HYBRIDRT_STEP_PROGRAM", "1")
    llm = LLM(ckpt, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=1,
              cache_memory=8 << 20, quantization="int8")
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate([[3, 4, 5]], sp, use_tqdm=False)
    be = llm.engine.runner.model.backend
    (program,) = [p for p in be.programs.values() if p is not None]
    program.ops[2, 0] = 99
    with pytest.raises(RuntimeError, match=r"operation 2 \(code 99\) failed"):
        llm.generate([[3, 4, 5]], sp, use_tqdm=False)


def test_programs_share_their_buffers(ckpt, monkeypatch):
    """Every shape's program writes into the backend's one set of buffers, grown (and the
    programs pointing into the old ones dropped) when a step has more rows than they hold:
    one sequence, then three, then one again give the loop's bits, and the last two
    programs use the same buffers."""
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    runs = {}
    for program in (True, False):
        monkeypatch.setenv("HYBRIDRT_STEP_PROGRAM", "1" if program else "0")
        llm = LLM(ckpt, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=3,
                  cache_memory=8 << 20, quantization="int8")
        be = llm.engine.runner.model.backend
        runs[program] = [[output_bytes(o) for o in llm.generate(p, sp, use_tqdm=False)]
                         for p in (PROMPTS[:1], PROMPTS, PROMPTS[:1])]
        if program:
            one, three = (next(p for (rows, *_), p in be.programs.items() if rows == n)
                          for n in (1, 3))
            assert one.buffers["X"].data_ptr() == three.buffers["X"].data_ptr()
            assert be.step_buffers["X"].numel() >= 3 * one.D
    assert runs[True] == runs[False]


def _mixed_run(ckpt, ks, fast: bool):
    """Requests at k = ``ks`` (one each, ``PROMPTS``) in one engine: (greedy output bytes, per
    step (query lengths, whether the backend's loop ran it))."""
    llm = LLM(ckpt, dtype="bfloat16", tokenizer=None, max_model_len=64, max_num_seqs=3,
              cache_memory=8 << 20, speculative_tokens=max(ks))
    be, eng = llm.engine.runner.model.backend, llm.engine
    if not fast:
        be.fast = None
    steps, forward = [], be.forward

    def recorded(batch, *args):
        out = forward(batch, *args)
        steps.append((tuple(batch.query_lens), out is not None))
        return out

    be.forward = recorded
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    ids = [llm._add(p, sp, k) for p, k in zip(PROMPTS, ks)]
    done = {}
    while eng.has_unfinished_requests():
        for r in eng.step():
            if r.is_finished:
                done[r.request_id] = llm._output(eng.pop_request(r.request_id))
    return [output_bytes(done[i]) for i in ids], steps


def test_decodes_beside_verifications_run_the_backends_loop(ckpt):
    """A step where some sequences verify drafts and others decode (adaptive k drafts for some
    requests only) runs the backend's loop over its layers (one ``gdn_fused`` call per count of
    new tokens, one ``attn_decode`` call per count), not the model's own loop: the same greedy
    tokens and logprob bytes as the model's loop, and k = 0's tokens. (The three prompts
    prefill together in the first step: every later step of unequal lengths is such a step.)"""
    looped, steps = _mixed_run(ckpt, (2, 0, 1), fast=True)
    own, own_steps = _mixed_run(ckpt, (2, 0, 1), fast=False)
    mixed = [ran for lens, ran in steps if max(lens) <= 8 and len(set(lens)) > 1]
    assert mixed and all(mixed), steps
    assert not any(ran for _, ran in own_steps)
    assert looped == own
    plain, _ = _mixed_run(ckpt, (0, 0, 0), fast=True)
    assert [t for t, _ in looped] == [t for t, _ in plain]
