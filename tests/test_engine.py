"""Engine behaviour: continuous batching, chunked prefill and preemption leave greedy outputs
unchanged, and nothing leaks."""

import contextlib

import pytest
import torch

from hybridrt.bench.fixtures import hf_reference_model, tiny_text_config, write_random_checkpoint
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
from hybridrt.statecache import CacheCapacityError, CacheTensors

MAX_TOKENS = 10
TEXT_CONFIG = tiny_text_config()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), TEXT_CONFIG, seed=3)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, 97, (n,), generator=g).tolist() for n in (5, 17, 40, 70, 1, 33)]


@pytest.fixture(scope="module")
def dense_greedy(ckpt, prompts):
    """Greedy continuations from transformers with no cache: full recompute every step."""
    from hybridrt.loader import load_model

    net, _, _ = load_model(ckpt, "float32")
    ref = hf_reference_model(TEXT_CONFIG, dict(net.state_dict()))
    outs = []
    for p in prompts:
        ids = list(p)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        outs.append(ids[len(p):])
    return outs


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def make_llm(ckpt, **kw):
    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("cache_memory", 32 << 20)
    return LLM(ckpt, dtype="float32", **kw)


def test_batch_greedy_equals_dense_recompute(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.engine.cache.all_free()


def test_batch_of_n_equals_batch_of_one(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt)
    for p, expected in zip(prompts, dense_greedy):
        (out,) = llm.generate([p], GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == expected


def test_small_prefill_chunks_keep_outputs(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt, max_num_batched_tokens=7)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy
    assert llm.engine.stats["num_prefill_tokens"] == sum(len(p) for p in prompts)


def _budget(llm_probe, num_blocks, num_slots):
    cfg, dtype = llm_probe.config, llm_probe.dtype
    extra = llm_probe.model.num_attention_caches - len(cfg.full_attention_layers)
    return (num_blocks * CacheTensors.bytes_per_block(cfg, 16, dtype, extra)
            + num_slots * CacheTensors.bytes_per_slot(cfg, dtype, 16, extra))


def test_preemption_keeps_outputs_and_leaks_nothing(ckpt, prompts, dense_greedy):
    probe = make_llm(ckpt, max_model_len=96)
    # 7 blocks of 16 tokens: one 96-token request fits, the whole batch does not.
    budget = _budget(probe, num_blocks=7, num_slots=10)  # null + 8 requests + 1 session snapshot
    llm = make_llm(ckpt, max_model_len=96, cache_memory=budget, max_num_batched_tokens=16)
    assert llm.cache_sizing.num_blocks == 7
    llm.engine.scheduler.admission_control = False  # admission control would avoid them all
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy
    assert llm.engine.stats["num_preemptions"] > 0
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    cache = llm.engine.cache
    assert cache.all_free()
    usage = cache.usage()
    assert usage.num_free_blocks == 7 and usage.num_free_slots == usage.num_slots
    assert not cache.owners()


def test_slot_pool_bounds_concurrency(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt, max_num_seqs=2)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy
    assert llm.engine.cache.all_free()


def test_budget_that_cannot_hold_one_request_is_refused(ckpt):
    with pytest.raises(CacheCapacityError, match="cannot hold one request"):
        make_llm(ckpt, max_model_len=128, cache_memory=4096)


def test_abort_frees_resources(ckpt, prompts):
    llm = make_llm(ckpt)
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    eng.step()
    eng.abort_request(ids[1])
    eng.abort_request(ids[-1])
    while eng.has_unfinished_requests():
        eng.step()
    outs = {i: eng.make_output(eng.pop_request(i)) for i in ids}
    assert outs[ids[1]].outputs[0].finish_reason == "abort"
    assert outs[ids[0]].outputs[0].finish_reason == "length"
    assert eng.cache.all_free()


def test_abort_waiting_request(ckpt, prompts):
    llm = make_llm(ckpt, max_num_seqs=1)
    eng = llm.engine
    a = eng.add_request(prompts[0], GREEDY)
    b = eng.add_request(prompts[1], GREEDY)
    eng.step()
    eng.abort_request(b)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.requests[b].finish_reason == "abort"
    assert eng.requests[a].finish_reason == "length"
    assert eng.cache.all_free()


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "prompt is empty"),
        ([5] * 130, "max_model_len"),
        ([5, 1000], "outside"),
        ({"prompt_token_ids": [3, 4]}, None),  # valid: the dict form
    ],
    ids=["empty", "too-long", "bad-token-id", "dict-ok"],
)
def test_bad_prompt_fails_alone(ckpt, prompts, dense_greedy, bad, match):
    llm = make_llm(ckpt)
    batch = [prompts[0], bad, prompts[2]]
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == dense_greedy[0]
    assert outs[2].outputs[0].token_ids == dense_greedy[2]
    if match is None:
        assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == MAX_TOKENS
    else:
        assert isinstance(outs[1].error, ValueError)
        assert match in str(outs[1].error)
        assert outs[1].outputs[0].finish_reason == "error"
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"stop": 7}, "stop"),
    ],
    ids=["neg-temp", "nan-temp", "top_p-0", "top_p-1.5", "neg-max-tokens", "stop-int"],
)
def test_bad_params_fail_alone(ckpt, prompts, dense_greedy, params, field):
    llm = make_llm(ckpt)
    good = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    outs = llm.generate(prompts[:3], [good, params, good], use_tqdm=False)
    assert isinstance(outs[1].error, ValueError) and field in str(outs[1].error)
    assert outs[0].outputs[0].token_ids == dense_greedy[0]
    assert outs[2].outputs[0].token_ids == dense_greedy[2]


def test_eos_and_stop_token_ids_finish_with_stop(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt)
    target = dense_greedy[3][4]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[target])
    (out,) = llm.generate([prompts[3]], sp, use_tqdm=False)
    first = dense_greedy[3].index(target)
    assert out.outputs[0].token_ids == dense_greedy[3][:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == target


def test_min_tokens_suppresses_stop(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt)
    target = dense_greedy[3][0]
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[target],
                        min_tokens=3)
    (out,) = llm.generate([prompts[3]], sp, use_tqdm=False)
    assert target not in out.outputs[0].token_ids[:3]
    assert len(out.outputs[0].token_ids) >= 3


def test_seeded_sampling_is_reproducible_across_batches(ckpt, prompts):
    llm = make_llm(ckpt)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS,
                        ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (alone,) = llm.generate([prompts[2]], sp, use_tqdm=False)
    mixed = llm.generate([prompts[0], prompts[2], prompts[4]], [other, sp, other],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    sp2 = sp.clone(seed=4321)
    (diff,) = llm.generate([prompts[2]], sp2, use_tqdm=False)
    assert diff.outputs[0].token_ids != alone.outputs[0].token_ids


def test_logprobs_are_returned(ckpt, prompts):
    llm = make_llm(ckpt)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([prompts[1]], sp, use_tqdm=False)
    lps = out.outputs[0].logprobs
    assert len(lps) == 4
    for tok, lp in zip(out.outputs[0].token_ids, lps):
        assert tok in lp and len(lp) >= 3
        assert lp[tok] == pytest.approx(max(lp.values()))  # greedy picks the top logprob


def test_stream_tokens_match_generate(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt)
    toks = list(llm.stream_tokens(prompts[1], GREEDY))
    assert toks == dense_greedy[1]
    assert llm.engine.cache.all_free()


def test_metrics_are_reported(ckpt, prompts):
    llm = make_llm(ckpt)
    (out,) = llm.generate([prompts[2]], GREEDY, use_tqdm=False)
    m = out.metrics
    assert m["num_prompt_tokens"] == len(prompts[2])
    assert m["num_generated_tokens"] == MAX_TOKENS
    assert m["time_to_first_token"] > 0 and m["decode_tokens_per_s"] > 0


# Async scheduling: a decode step launched before the previous step's tokens are read (on by
# default on CUDA; forced on here). The outputs must be those of the synchronous engine.
def _chained(llm) -> int:
    return llm.engine.stats["num_chained_steps"]


def test_async_scheduling_keeps_outputs(ckpt, prompts, dense_greedy):
    assert not make_llm(ckpt).engine.async_scheduling  # off on CPU by default
    llm = make_llm(ckpt, async_scheduling=True)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    # every step after the prompts, but the last few where requests reach max_tokens, chains
    assert _chained(llm) >= MAX_TOKENS - 3
    assert llm.engine.stats["num_decode_tokens"] == len(prompts) * MAX_TOKENS
    assert llm.engine.cache.all_free() and llm.engine._inflight is None


def test_async_scheduling_stops_where_the_sync_engine_does(ckpt, prompts, dense_greedy):
    """Requests stopping on tokens the host learns one step late (stop ids, min_tokens),
    and at different max_tokens: the same tokens and reasons; the step launched for a
    request that has just stopped is dropped."""
    params = []
    for i, toks in enumerate(dense_greedy):
        stop = [] if i % 3 == 0 else [toks[2 + i % 5]]
        params.append(SamplingParams(temperature=0, max_tokens=4 + 2 * i, stop_token_ids=stop,
                                     min_tokens=i % 4))
    sync = make_llm(ckpt).generate(prompts, params, use_tqdm=False)
    llm = make_llm(ckpt, async_scheduling=True)
    eng = llm.engine  # stepped by hand: the requests are read after the last step
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_unfinished_requests():
        eng.step()
    outs = [eng.make_output(eng.pop_request(i)) for i in ids]
    for a, b, toks in zip(outs, sync, dense_greedy):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert (a.outputs[0].finish_reason, a.outputs[0].stop_reason) == (
            b.outputs[0].finish_reason, b.outputs[0].stop_reason)
        assert a.outputs[0].token_ids == toks[:len(a.outputs[0].token_ids)]
    assert eng.stats["num_decode_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert {o.outputs[0].finish_reason for o in outs} == {"stop", "length"}
    assert _chained(llm) > 0 and llm.engine.cache.all_free()


def test_async_scheduling_with_preemption(ckpt, prompts, dense_greedy):
    probe = make_llm(ckpt, max_model_len=96)
    budget = _budget(probe, num_blocks=7, num_slots=10)
    llm = make_llm(ckpt, max_model_len=96, cache_memory=budget, max_num_batched_tokens=16,
                   async_scheduling=True)
    llm.engine.scheduler.admission_control = False  # admission control would avoid them all
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == dense_greedy
    assert llm.engine.stats["num_preemptions"] > 0 and _chained(llm) > 0
    assert llm.engine.cache.all_free()


def test_async_scheduling_abort_and_arrival_mid_flight(ckpt, prompts, dense_greedy):
    """Abort a request while a step holding it is in flight, and add one: the others go on
    with their own tokens, nothing leaks."""
    llm = make_llm(ckpt, async_scheduling=True)
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in prompts[:3]]
    while not (eng._inflight is not None and _chained(llm) >= 2):
        eng.step()
    eng.abort_request(ids[1])  # it is in the step in flight
    late = eng.add_request(prompts[3], GREEDY)
    while eng.has_unfinished_requests():
        eng.step()
    req = {i: eng.pop_request(i) for i in ids + [late]}
    assert req[ids[1]].finish_reason == "abort"
    assert len(req[ids[1]].output_token_ids) < MAX_TOKENS
    assert req[ids[1]].output_token_ids == dense_greedy[1][:len(req[ids[1]].output_token_ids)]
    for i, k in ((ids[0], 0), (ids[2], 2), (late, 3)):
        assert req[i].output_token_ids == dense_greedy[k]
    assert eng.cache.all_free() and eng._inflight is None


def test_async_scheduling_seeded_sampling(ckpt, prompts):
    """Sampling with per-request seeds: the same tokens as the synchronous engine."""
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=100 + i,
                             max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(4)]
    sync = make_llm(ckpt).generate(prompts[:4], params, use_tqdm=False)
    llm = make_llm(ckpt, async_scheduling=True)
    outs = llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in sync]
    assert _chained(llm) > 0


# The observer: LLMEngine's extension point for timing the phases of a step ------------------
class PhaseLog:
    def __init__(self):
        self.names: list[str] = []
        self.open = 0  # phases entered and not left: they must not nest

    @contextlib.contextmanager
    def phase(self, name):
        assert self.open == 0, f"{name} inside another phase"
        self.names.append(name)
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


PHASES = ["schedule", "prepare", "forward", "logits", "sample", "update"]


def test_observer_sees_the_six_phases_of_a_decode_step_in_order(ckpt, prompts, dense_greedy):
    llm = make_llm(ckpt)
    eng = llm.engine
    assert eng.observer is None
    rid = eng.add_request(prompts[0], GREEDY)
    eng.step()  # the prefill
    eng.observer = log = PhaseLog()
    eng.step()  # a decode step
    assert log.names == PHASES and log.open == 0
    eng.observer = None
    while eng.has_unfinished_requests():
        eng.step()
    assert log.names == PHASES  # detached: seen no more
    assert eng.pop_request(rid).output_token_ids == dense_greedy[0]


def test_observer_sees_a_chained_step_inside_the_step_launching_it(ckpt, prompts):
    llm = make_llm(ckpt, async_scheduling=True)
    eng = llm.engine
    eng.add_request(prompts[0], GREEDY)
    eng.step()  # the prefill (a prompt chunk: nothing chained)
    eng.observer = log = PhaseLog()
    eng.step()  # the first decode step: it chains the second before its update
    launched = ["prepare", "forward", "logits", "sample"]
    assert log.names == ["schedule", *launched, *launched, "update"]
    log.names.clear()
    eng.step()  # applies the chained step, chaining the next one
    assert log.names == [*launched, "update"]
    assert eng.stats["num_chained_steps"] == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_steps_take_the_argmax_of_the_heads_own_dtype(ckpt, prompts, monkeypatch,
                                                             async_scheduling):
    """A step whose rows all take the plain argmax gets the LM head's bf16 logits (no fp32 copy);
    a step with a row that needs more (logprobs, temperature) gets fp32. The tokens are those
    of fp32 logits everywhere."""
    from hybridrt.runner import ModelRunner
    from hybridrt.sampler import Sampler

    def run(force_fp32: bool):
        if force_fp32:
            logits = ModelRunner.logits
            monkeypatch.setattr(ModelRunner, "logits",
                                lambda self, hidden, batch, fp32=True: logits(self, hidden, batch))
        seen = []
        sample = Sampler.sample

        def spy(self, logits, rows):
            seen.append((logits.dtype, tuple(r.params.logprobs is not None
                                             or not r.params.greedy for r in rows)))
            return sample(self, logits, rows)

        monkeypatch.setattr(Sampler, "sample", spy)
        llm = LLM(ckpt, dtype="bfloat16", max_model_len=128, max_num_seqs=8,
                  cache_memory=32 << 20, async_scheduling=async_scheduling)
        lp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
        hot = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, seed=5)
        outs = llm.generate(prompts[:3], [GREEDY, lp, hot], use_tqdm=False)
        greedy = llm.generate(prompts[3:5], GREEDY, use_tqdm=False)
        monkeypatch.undo()
        return [o.outputs[0] for o in outs + greedy], seen

    fast, seen = run(False)
    slow, seen_fp32 = run(True)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert fast[1].logprobs == slow[1].logprobs
    assert {d for d, _ in seen_fp32} == {torch.float32}
    for dtype, needs in seen:  # bf16 exactly where no row needs more than the argmax
        assert dtype == (torch.float32 if any(needs) else torch.bfloat16), (dtype, needs)
    assert {d for d, _ in seen} == {torch.float32, torch.bfloat16}


def test_a_step_is_one_runner_call_and_one_cache_commit(ckpt, prompts, dense_greedy,
                                                        monkeypatch):
    """schedule -> execute -> update: each step runs the model through one runner call
    (``execute``) and commits the prefix cache through one call (``commit_step``): a step's
    blocks and checkpoints are indexed there (or by ``release``, for a request that finished),
    never by the engine; the tokens are the dense recompute's."""
    llm = make_llm(ckpt, checkpoint_interval=16, max_num_batched_tokens=32)
    eng, cache = llm.engine, llm.engine.cache
    calls, inside = [], []

    def entry(target, name):  # the calls the step makes into the runner and the cache
        method = getattr(target, name)

        def spy(*args, **kw):
            calls.append(name)
            inside.append(name)
            try:
                return method(*args, **kw)
            finally:
                inside.pop()
        monkeypatch.setattr(target, name, spy)

    def indexing(name):  # the cache's own indexing: only inside those calls
        method = getattr(cache, name)

        def spy(*args, **kw):
            assert inside, f"{name} called outside commit_step / release"
            calls.append(name)
            return method(*args, **kw)
        monkeypatch.setattr(cache, name, spy)

    entry(eng.runner, "execute")
    entry(cache, "commit_step")
    entry(cache, "release")
    indexing("save_checkpoint")
    indexing("commit_blocks")
    ids = [eng.add_request(p, GREEDY) for p in prompts[2:4]]
    seen = set()
    while eng.has_unfinished_requests():
        calls.clear()
        eng.step()
        assert calls.count("execute") == 1 and calls.count("commit_step") == 1, calls
        seen.update(calls)
    assert {"save_checkpoint", "commit_blocks", "release"} <= seen
    assert [eng.pop_request(r).output_token_ids for r in ids] == dense_greedy[2:4]
    assert cache.all_free()
