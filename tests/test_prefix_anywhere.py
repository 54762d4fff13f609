"""The prefix cache at any position (statecache/branch_points.py): raw prompts that share a
prefix with no message boundary in it resume at their branch point, whether they come one after
another (the cached blocks tell where the branch is; the lead-in checkpoints give the second
request half) or together as one batch (the queued prompts' common prefixes are known before
any prefill). Exactness: greedy tokens and logprobs equal a cold engine's, fp32 and bf16, with
and without speculation.
"""

from __future__ import annotations

import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.statecache.branch_points import BranchPoints, add_position, common_prefix
from hybridrt.statecache.prefix import checkpoint_positions

TINY = tiny_text_config()
SHARED = 700


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("anywhere"), TINY, seed=11)


def make(ckpt, k, dtype, caching=True, **kw) -> LLM:
    """An engine with the default checkpoint policy (interval 2048 and its lead-in); bf16 in
    the batch-invariant mode, so that a cold run is the bit-exact reference."""
    kw = {"dtype": dtype, "max_model_len": 1024, "max_num_seqs": 8, "cache_memory": 96 << 20,
          "max_num_batched_tokens": 128, "speculative_tokens": k,
          "batch_invariant": dtype == "bfloat16", **kw}
    llm = LLM(ckpt, enable_prefix_caching=caching, **kw)
    step = llm.engine.step

    def checked_step():
        out = step()
        llm.engine.cache.check()
        return out

    llm.engine.step = checked_step
    return llm


def raw(n: int, seed: int) -> list[int]:
    """Raw token ids (no message start: token 2 is never drawn)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()


def prompts() -> list[list[int]]:
    shared = raw(SHARED, 1)
    return [shared + raw(20 + 3 * i, 100 + i) for i in range(7)]


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


def assert_exact(got, want) -> None:
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        lg = [lp[t] for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
        lw = [lp[t] for lp, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]
        assert lg == pytest.approx(lw, abs=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [0, 2])
def test_raw_prompts_one_after_another_and_as_one_batch(tiny, k, dtype):
    """7 raw prompts sharing 700 tokens. One after another: the second resumes at the lead-in
    checkpoint (512 tokens: at least half) and checkpoints where the first one's cached blocks
    end; every later one resumes there (688 tokens: within a block of the branch, over 90%).
    As one batch into an emptied cache: the first computes the shared prefix and checkpoints
    at the branch point the queue revealed, and every other one resumes exactly there."""
    ps = prompts()
    want = make(tiny, k, dtype, caching=False).generate(ps, GREEDY, use_tqdm=False)
    llm = make(tiny, k, dtype)
    seq = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in ps]
    cached = [o.num_cached_tokens for o in seq]
    assert cached[0] == 0
    assert cached[1] >= SHARED // 2, cached
    assert all(c >= 0.9 * SHARED for c in cached[2:]), cached
    assert_exact(seq, want)
    assert llm.reset_prefix_cache()
    batch = llm.generate(ps, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in batch] == [0] + [SHARED] * 6
    assert_exact(batch, want)


def test_a_prefix_shared_by_part_of_a_batch_and_a_later_request(tiny):
    """Three groups in one batch: two prompts sharing 300 tokens with the rest and 500 with each
    other; every branch is checkpointed exactly, and a request arriving afterwards that shares
    500 tokens with the pair resumes there."""
    base = raw(300, 3)
    pair = base + raw(200, 4)
    batch = [pair + raw(30, 5), pair + raw(40, 6), base + raw(60, 7), raw(90, 8)]
    llm = make(tiny, 0, "float32")
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 500, 300, 0]
    later = pair + raw(25, 9)
    (out,) = llm.generate([later], GREEDY, use_tqdm=False)
    assert out.num_cached_tokens == 500
    cold = make(tiny, 0, "float32", caching=False)
    assert_exact(outs + [out], cold.generate(batch + [later], GREEDY, use_tqdm=False))


def test_disjoint_prompts_add_no_checkpoint(tiny):
    """Prompts that share nothing get only the policy's checkpoints: no branch point is
    found, and the index forgets every finished request."""
    llm = make(tiny, 0, "float32")
    ps = [raw(100 + i, 50 + i) for i in range(6)]
    llm.generate(ps, GREEDY, use_tqdm=False)
    bp = llm.engine.scheduler.branch_points
    assert bp.stats == {"branch_points_queued": 0, "branch_points_cached": 0}
    assert not bp._holders and not bp._chains


def test_branch_point_helpers():
    assert common_prefix([1, 2, 3, 4], [1, 2, 5], 1) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2

    class Req:
        prompt_token_ids = list(range(10))
        num_computed_tokens = 4
        checkpoint_at = [3, 9]

    r = Req()
    assert add_position(r, 6) and r.checkpoint_at == [3, 6, 9]
    assert not add_position(r, 6) and not add_position(r, 4)  # there / computed already
    assert not add_position(r, 12)  # clamped to before the last token: 9, there
    assert BranchPoints().stats["branch_points_queued"] == 0


def test_lead_in_positions():
    assert checkpoint_positions(list(range(3000)), set(), 2048) == [256, 512, 1024, 2048, 2999]
    assert checkpoint_positions(list(range(600)), set(), 512) == [256, 512, 599]
    assert checkpoint_positions(list(range(600)), set(), 0) == [599]
    assert checkpoint_positions(list(range(300)), set(), 64)[:3] == [64, 128, 192]
