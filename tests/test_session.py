"""Sessions: multi-turn reuse of KV blocks and GDN state, rollback for regenerate, cleanup."""

import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.testing import tiny_text_config, write_random_checkpoint

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=[0, 2], ids=["k0", "spec-k2"])
def llm(request, tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("sess"), tiny_text_config(), seed=11)
    return LLM(d, dtype="float32", max_model_len=512, max_num_seqs=4, cache_memory=32 << 20,
               speculative_tokens=request.param)


def _ids(n, seed):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fresh(llm, prompt):
    return llm.generate([prompt], SP, use_tqdm=False)[0].outputs[0].token_ids


def test_second_turn_prefills_only_new_tokens(llm):
    s = llm.open_session()
    p1 = _ids(70, 1)  # crosses the 64-token chunk and several KV blocks
    t1 = list(llm.stream_tokens(p1, SP, session=s))
    assert t1 == _fresh(llm, p1)
    p2 = p1 + t1 + _ids(9, 2)
    t2 = list(llm.stream_tokens(p2, SP, session=s))
    m = llm.last_stream_output.metrics
    # the last answer token was sampled but never fed: it is prefilled with the new ones
    assert s.last_reused_tokens == len(p1) + len(t1) - 1
    assert m["num_prefilled_tokens"] == len(p2) - s.last_reused_tokens == 10
    assert t2 == _fresh(llm, p2)
    llm.close_session(s)
    assert llm.engine.cache.all_free()


def test_regenerate_restores_the_state_before_the_answer(llm):
    s = llm.open_session()
    p = _ids(40, 3)
    first = list(llm.stream_tokens(p, SP, session=s))
    # Poison the previous answer's effect: regenerating must not see it in the GDN state.
    again = list(llm.stream_tokens(p, SP, session=s))
    assert s.last_reused_tokens == len(p) - 1  # from the snapshot, not from scratch
    assert again == first == _fresh(llm, p)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    a = list(llm.stream_tokens(p, sampled, session=s))
    b = llm.generate([p], sampled, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    llm.close_session(s)
    assert llm.engine.cache.all_free()


def test_divergence_inside_the_cached_prefix_recomputes(llm):
    s = llm.open_session()
    p1 = _ids(30, 4)
    t1 = list(llm.stream_tokens(p1, SP, session=s))
    p2 = p1[:10] + _ids(25, 5)  # shares only 10 tokens: no snapshot covers that
    t2 = list(llm.stream_tokens(p2, SP, session=s))
    assert s.last_reused_tokens == 0
    assert t2 == _fresh(llm, p2)
    assert t1 == _fresh(llm, p1)
    llm.close_session(s)


def test_clear_and_abort_keep_the_session_consistent(llm):
    s = llm.open_session()
    p = _ids(20, 6)
    list(llm.stream_tokens(p, SP, session=s))
    llm.reset_session(s)
    assert s.token_ids == [] and not llm.engine.cache.block_tables.get(s.cache_key)
    it = llm.stream_tokens(p, SP, session=s)
    got = [next(it), next(it)]
    it.close()  # Ctrl-C in the chat: the partial answer stays cached
    assert not s.busy and len(s.token_ids) == len(p) + 1
    p3 = p + got + _ids(3, 7)
    t3 = list(llm.stream_tokens(p3, SP, session=s))
    assert s.last_reused_tokens == len(p) + 1
    assert t3 == _fresh(llm, p3)
    llm.close_session(s)
    assert llm.engine.cache.all_free()


def test_session_rejects_concurrent_requests(llm):
    s = llm.open_session()
    llm.engine.add_request(_ids(5, 8), SP, session=s)
    with pytest.raises(ValueError, match="running request"):
        llm.engine.add_request(_ids(5, 9), SP, session=s)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.close_session(s)
    assert llm.engine.cache.all_free()


def test_snapshot_at_the_generation_prompt_serves_a_rewritten_history(llm):
    """A template that re-renders the last answer differently (Qwen's drops its think block)
    diverges right after the previous turn's generation prompt starts: a snapshot there lets
    the next turn reuse everything before it."""
    s = llm.open_session()
    history, gen_prompt = _ids(40, 10), _ids(4, 11)
    p1 = history + gen_prompt
    t1 = list(llm.stream_tokens(p1, SP, session=s, snapshot_at=len(history)))
    assert s.snapshot_len == len(history)
    p2 = history + t1[:5] + _ids(6, 12)  # history rewritten after the snapshot point
    t2 = list(llm.stream_tokens(p2, SP, session=s, snapshot_at=len(p2) - 3))
    assert s.last_reused_tokens == len(history)
    assert t2 == _fresh(llm, p2)
    with pytest.raises(ValueError, match="snapshot_at"):
        llm.engine.add_request(p1, SP, snapshot_at=3)  # no session
    llm.close_session(s)
    assert llm.engine.cache.all_free()
