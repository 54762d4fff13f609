"""Sessions: multi-turn reuse of KV blocks and GDN state through the prefix cache (pinned between
turns), rollback for regenerate, cleanup. References come from a twin engine without prefix
caching (``cold``)."""

import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.statecache import CacheTensors

SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


COLD = {}  # checkpoint directory -> an engine on it without prefix caching


@pytest.fixture(scope="module", params=[0, 2], ids=["k0", "spec-k2"])
def llm(request, tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("sess"), tiny_text_config(), seed=11)
    return LLM(d, dtype="float32", max_model_len=512, max_num_seqs=4, cache_memory=32 << 20,
               speculative_tokens=request.param)


def _ids(n, seed):
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fresh(llm, prompt, params=SP):
    """What the prompt gives with nothing cached (the same checkpoint, k = 0: speculation is
    lossless)."""
    d = str(llm.model_path)
    if d not in COLD:
        COLD[d] = LLM(d, dtype="float32", max_model_len=512, max_num_seqs=4,
                      cache_memory=32 << 20, enable_prefix_caching=False)
    return COLD[d].generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


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
    llm.reset_prefix_cache()  # pinned checkpoints stay: the session's request still hits
    b = llm.generate([p], sampled, use_tqdm=False)[0]
    assert a == b.outputs[0].token_ids and b.num_cached_tokens == len(p) - 1
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
    assert not s.pins and not llm.engine.cache.block_table(s.cache_key)
    it = llm.stream_tokens(p, SP, session=s)
    got = [next(it), next(it)]
    it.close()  # Ctrl-C in the chat: the partial answer stays cached
    p3 = p + got + _ids(3, 7)
    assert not s.busy and llm.engine.cached_tokens(p3) == len(p) + 1
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
    assert len(history) in [c.num_tokens for c in s.pins]
    p2 = history + t1[:5] + _ids(6, 12)  # history rewritten after the snapshot point
    assert p2[len(history)] != p1[len(history)]
    t2 = list(llm.stream_tokens(p2, SP, session=s, snapshot_at=len(p2) - 3))
    assert s.last_reused_tokens == len(history)
    assert t2 == _fresh(llm, p2)
    with pytest.raises(ValueError, match="snapshot_at"):
        llm.engine.add_request(p1, SP, snapshot_at=0)
    llm.close_session(s)
    assert llm.engine.cache.all_free()


# Sessions as users of the cache ----------------------------------------------------------------
def _ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("sess-tight"), tiny_text_config(),
                                   seed=11)


def _bounded(llm, max_steps=2000):
    """Make engine.step raise instead of spinning forever."""
    step, calls = llm.engine.step, [0]

    def guarded():
        calls[0] += 1
        assert calls[0] <= max_steps, "the engine is not making progress"
        return step()

    llm.engine.step = guarded


def _tight_llm(d, k, **kw):
    """Blocks for exactly one max_model_len request (96 + k tokens: 7 blocks)."""
    probe = LLM(d, dtype="float32", max_model_len=96, cache_memory=32 << 20,
                speculative_tokens=k)
    cfg, dtype = probe.config, probe.dtype
    extra = probe.model.num_attention_caches - len(cfg.full_attention_layers)
    kw.setdefault("max_num_seqs", 2)
    max_num_seqs, sessions = kw["max_num_seqs"], kw.get("max_num_sessions", 1)
    per_slot = CacheTensors.bytes_per_slot(cfg, dtype, 16, extra)
    pinned = 2 * sessions * per_slot  # each session pins two checkpoints between its turns
    budget = (7 * CacheTensors.bytes_per_block(cfg, 16, dtype, extra)
              + (1 + max_num_seqs * (1 + k)) * per_slot + pinned)
    llm = LLM(d, dtype="float32", max_model_len=96, cache_memory=budget, speculative_tokens=k,
              max_num_batched_tokens=32, checkpoint_share=(pinned + 1) / budget, **kw)
    assert llm.cache_sizing.num_checkpoint_slots == 2 * sessions
    assert llm.cache_sizing.num_blocks == 7
    _bounded(llm)
    return llm


@pytest.mark.parametrize("k", [0, 2])
def test_sessions_take_no_memory_of_their_own(tmp_path_factory, k):
    """Sessions only pin what the prefix cache holds: the plan has no slots for them, and with
    max_num_seqs=1 and open sessions a plain request still runs (it used to spin forever when a
    session took the only request slot)."""
    d = _ckpt(tmp_path_factory)
    plans = [LLM(d, dtype="float32", max_model_len=64, max_num_seqs=1, cache_memory=32 << 20,
                 speculative_tokens=k, max_num_sessions=n).cache_sizing for n in (1, 8)]
    assert plans[0] == plans[1]
    llm = LLM(d, dtype="float32", max_model_len=64, max_num_seqs=1, cache_memory=32 << 20,
              speculative_tokens=k, max_num_sessions=2)
    p = _ids(20, 20)
    want = _fresh(llm, p)
    s1, s2 = llm.open_session(), llm.open_session()
    with pytest.raises(RuntimeError, match="max_num_sessions"):
        llm.open_session()
    _bounded(llm)
    assert _fresh(llm, p) == want
    assert list(llm.stream_tokens(p, SP, session=s1)) == want
    assert llm.generate([p], SP, use_tqdm=False)[0].outputs[0].token_ids == want
    llm.close_session(s1)
    llm.close_session(s2)
    assert llm.engine.cache.all_free()
    llm.close_session(llm.open_session())


@pytest.mark.parametrize("k", [0, 2])
def test_idle_session_is_evicted_and_its_next_turn_reprefills(tmp_path_factory, k):
    d = _ckpt(tmp_path_factory)
    llm = _tight_llm(d, k)
    p1, big = _ids(50, 21), _ids(80, 22)
    want_big = _fresh(llm, big)
    s = llm.open_session()
    t1 = list(llm.stream_tokens(p1, SP, session=s))
    assert llm.engine.cache.holds(s.cache_key) and s.pins
    # 80 + 12 tokens need 6 of the 7 blocks: the idle session's pins have to go
    out = llm.generate([big], SP, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == want_big
    assert llm.engine.stats["num_session_evictions"] == 1 and not s.pins
    p2 = p1 + t1 + _ids(5, 23)
    left = llm.engine.cached_tokens(p2)  # what the big request's blocks did not evict
    assert left < len(p1) + len(t1) - 1
    t2 = list(llm.stream_tokens(p2, SP, session=s))
    m = llm.last_stream_output.metrics
    assert m["session_cache_evicted"] and m["num_prefilled_tokens"] == len(p2) - left
    p3 = p2 + t2 + _ids(4, 24)
    t3 = list(llm.stream_tokens(p3, SP, session=s))
    m = llm.last_stream_output.metrics
    assert not m["session_cache_evicted"] and m["num_prefilled_tokens"] == 5
    assert llm.engine.stats["num_session_evictions"] == 1
    assert t2 == _fresh(llm, p2) and t3 == _fresh(llm, p3)
    llm.close_session(s)
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize("k", [0, 2])
def test_sessions_and_requests_under_pressure_all_finish_correctly(tmp_path_factory, k):
    """Two sessions' next turns and two long plain requests queued together, a third session
    idle, on a cache that holds one long request: the idle session's cache is evicted, the two
    turns reuse theirs, and every output is the one computed alone."""
    d = _ckpt(tmp_path_factory)
    llm = _tight_llm(d, k, max_num_seqs=3, max_num_sessions=3)
    eng = llm.engine
    sessions = [llm.open_session() for _ in range(3)]
    nexts = []
    for i, s in enumerate(sessions):  # 2 blocks each after their first turn
        p = _ids(10 + 4 * i, 30 + i)
        nexts.append(p + list(llm.stream_tokens(p, SP, session=s)) + _ids(6, 40 + i))
    assert eng.stats["num_session_evictions"] == 0
    plain = [_ids(75, 50), _ids(60, 51)]
    rids = [eng.add_request(p, SP, session=s) for s, p in zip(sessions[:2], nexts)]
    rids += [eng.add_request(p, SP) for p in plain]
    while eng.has_unfinished_requests():
        eng.step()
    outs = [eng.make_output(eng.pop_request(r)) for r in rids]
    # the idle one went first; finished turns are idle too, and evictable
    assert eng.stats["num_session_evictions"] >= 1 and not sessions[2].pins
    for o, p in zip(outs[:2], nexts):
        assert not o.metrics["session_cache_evicted"]
        assert o.metrics["num_prefilled_tokens"] < len(p)
    t = list(llm.stream_tokens(nexts[2], SP, session=sessions[2]))
    assert llm.last_stream_output.metrics["session_cache_evicted"]
    for o, p in zip(outs, nexts[:2] + plain):
        assert o.error is None and o.outputs[0].token_ids == _fresh(llm, p)
    assert t == _fresh(llm, nexts[2])
    for s in sessions:
        llm.close_session(s)
    assert eng.cache.all_free()


def test_a_request_that_can_never_be_scheduled_fails_with_a_clear_error(tmp_path_factory):
    """A cache smaller than the plan allows (built by hand): a request that cannot fit even
    in the empty cache fails with finish_reason 'error' instead of waiting forever."""
    from hybridrt.engine import LLMEngine
    from hybridrt.engine_args import EngineArgs
    from hybridrt.statecache import CacheCapacityError, CacheSizing, HybridCacheManager

    d = _ckpt(tmp_path_factory)
    llm = LLM(d, dtype="float32", max_model_len=128, max_num_seqs=2, cache_memory=32 << 20)
    cfg, dtype = llm.config, llm.dtype
    sizing = CacheSizing(num_blocks=3, num_slots=4, block_size=16,
                         bytes_per_block=CacheTensors.bytes_per_block(cfg, 16, dtype),
                         bytes_per_slot=CacheTensors.bytes_per_slot(cfg, dtype),
                         max_num_seqs=2, max_model_len=128, num_checkpoint_slots=1)
    cache = HybridCacheManager(cfg, sizing, dtype)
    args = EngineArgs(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=512,
                      block_size=16, enable_prefix_caching=False)
    eng = LLMEngine(llm.model, cfg, cache, args.resolved(cfg.max_position_embeddings, llm.device))
    small, large = _ids(20, 60), _ids(70, 61)  # 20 + 12 tokens fit in 3 blocks, 70 do not
    ids = [eng.add_request(p, SP) for p in (large, small)]
    for _ in range(100):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    out_large, out_small = (eng.make_output(eng.pop_request(r)) for r in ids)
    assert out_large.outputs[0].finish_reason == "error"
    assert isinstance(out_large.error, CacheCapacityError)
    assert "can never be scheduled" in str(out_large.error)
    assert out_small.error is None and out_small.outputs[0].token_ids == _fresh(llm, small)
    assert cache.all_free()


def test_cached_tokens_predicts_what_a_request_reuses(llm):
    """``LLMEngine.cached_tokens`` says what a request will take from the cache, and
    ``num_cached_tokens`` reports it: a continuation reuses every computed token, a divergence
    inside the answer resumes before the last prompt token, one inside the prompt at the
    snapshot, one before it nothing."""
    eng, k = llm.engine, llm.engine.speculative_tokens
    s = llm.open_session()
    p = _ids(40, 21)
    t = list(llm.stream_tokens(p, SP, session=s, snapshot_at=30))
    cont = p + t + _ids(5, 22)
    inside = p + t[:4] + [t[4] % 90 + 3 + (t[4] % 90 + 3 == t[4])]  # differs at answer token 4
    in_prompt = p[:35] + [p[35] % 90 + 3 + (p[35] % 90 + 3 == p[35])] + p[36:]
    before = p[:20] + [p[20] % 90 + 3 + (p[20] % 90 + 3 == p[20])] + p[21:]
    assert eng.cached_tokens(cont, k) == len(p) + len(t) - 1
    assert eng.cached_tokens(inside, k) == len(p) - 1
    assert eng.cached_tokens(in_prompt, k) == 30
    assert eng.cached_tokens(before, k) == 0
    assert eng.cached_tokens(p, k) == len(p) - 1  # the same prompt again
    for prompt in (inside, in_prompt, cont):
        want = eng.cached_tokens(prompt, k)
        out = list(llm.stream_tokens(prompt, SP, session=s))
        assert llm.last_stream_output.num_cached_tokens == want
        assert llm.last_stream_output.metrics["num_cached_tokens"] == want
        assert llm.last_stream_output.metrics["num_prefilled_tokens"] == len(prompt) - want
        assert out == _fresh(llm, prompt)
    llm.close_session(s)
    assert llm.engine.cache.all_free()
