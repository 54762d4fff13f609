"""The prefix cache (statecache/prefix.py): every request resumes from the longest cached prefix
of its prompt, and computes what a cold run computes: the same tokens, the same logprobs (to
the rounding of a different chunking), and with speculation the same drafts (the MTP layer's
cached KV is exact).

The workloads are the ones users bring (a shared system prompt, an agent history that
branches, a chat whose template rewrites its history), with k = 0 and k = 3, greedy and seeded
sampling, under a roomy and a tight cache; then one regression test per bug the other engines'
users reported. Tiny random models in fp32 use token 2 as the message start (checkpoints go
before it); the demo model (bf16, int8) its real chat template.
"""

from __future__ import annotations

import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.statecache import CacheTensors
from hybridrt.statecache.manager import HybridCacheManager, plan_cache
from hybridrt.statecache.prefix import checkpoint_positions

START = 2  # the tiny models' message start token
TINY = tiny_text_config()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("prefix"), TINY, seed=7)


def make(ckpt, k=0, caching=True, **kw) -> LLM:
    """An fp32 engine on ``ckpt`` that checks the cache's invariants after every step and
    records every request's drafts (``llm.drafts``: prompt -> the drafts of each step)."""
    kw = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 8, "cache_memory": 32 << 20,
          "max_num_batched_tokens": 64, "checkpoint_interval": 0, **kw}
    llm = LLM(ckpt, speculative_tokens=k, enable_prefix_caching=caching, **kw)
    eng = llm.engine
    eng.checkpoint_boundary_ids = frozenset({START})
    step = eng.step

    def checked_step():
        out = step()
        eng.cache.check()
        return out

    eng.step = checked_step
    llm.drafts = {}
    if eng.proposer is not None:
        propose = eng.proposer.propose

        def logged(plan, *args):
            got = propose(plan, *args)
            for d in got:
                llm.drafts.setdefault(tuple(d.request.prompt_token_ids), []).append(
                    list(d.token_ids))
            return got

        eng.proposer.propose = logged
    return llm


def msg(n: int, seed: int) -> list[int]:
    """A message: the start token, then ``n`` tokens that are neither it nor eos."""
    g = torch.Generator().manual_seed(seed)
    return [START] + torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()


def question(n: int, i: int) -> list[int]:
    """Question ``i``: a message whose first token (50 + i) no other question starts with, so
    questions share nothing after the start token (questions that do resume further: tests/
    test_prefix_anywhere.py)."""
    q = msg(n, 10 + i)
    q[1] = 50 + i
    return q


def greedy(n=12):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)


def sampled(seed, n=12):
    return SamplingParams(temperature=1.0, top_k=20, seed=seed, max_tokens=n, ignore_eos=True,
                          logprobs=2)


def chosen(out):
    c = out.outputs[0]
    return [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]


def assert_same(got, want, atol=1e-4):
    """Cached equals cold: tokens equal, the chosen tokens' logprobs to ``atol``."""
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for g, w in zip(got, want):
        assert chosen(g) == pytest.approx(chosen(w), abs=atol)


def assert_same_drafts(llm, cold, prompts):
    """With speculation, every step's drafts of every request equal the cold run's: the MTP
    layer read the same KV (a cached block or checkpoint tail with a stale MTP KV would change
    them)."""
    for p in prompts:
        assert llm.drafts.get(tuple(p)) == cold.drafts.get(tuple(p)), "drafts differ"


def tight(ckpt, k, num_blocks, num_checkpoint_slots, **kw) -> LLM:
    """``make`` with a cache of exactly ``num_blocks`` blocks, the requests' slots and
    ``num_checkpoint_slots`` more."""
    probe = make(ckpt, k, **kw)
    cfg, dtype = probe.config, probe.dtype
    extra = probe.model.num_attention_caches - len(cfg.full_attention_layers)
    per_slot = CacheTensors.bytes_per_slot(cfg, dtype, 16, extra)
    ckpts = num_checkpoint_slots * per_slot
    budget = (num_blocks * CacheTensors.bytes_per_block(cfg, 16, dtype, extra)
              + (1 + 8 * (1 + k)) * per_slot + ckpts)
    llm = make(ckpt, k, cache_memory=budget, checkpoint_share=(ckpts + 1) / budget, **kw)
    assert llm.cache_sizing.num_blocks == num_blocks
    assert llm.cache_sizing.num_checkpoint_slots == num_checkpoint_slots
    return llm


def test_a_burst_is_admitted_at_once_when_checkpoints_hold_the_slots(tiny):
    """Eight requests arriving together into a cache whose every state slot holds an earlier
    request's checkpoint and none is set aside for checkpoints: all eight run from the first
    step (their prompt-end checkpoints take only the slots left, here none), where reserving
    each one's checkpoint as it was admitted let 4, then 2, 1 and 1 in; then answer as a cold
    run does."""
    llm = tight(tiny, 0, num_blocks=64, num_checkpoint_slots=0)
    sp = [greedy()] * 8
    llm.generate([msg(9, 40 + i) for i in range(8)], sp, use_tqdm=False)
    assert llm.engine.cache.usage().num_checkpoints == 8  # every slot
    eng = llm.engine
    prompts = [msg(4 + i % 3, 60 + i) for i in range(8)]  # 5-7 tokens: one budget of 64
    ids = [eng.add_request(p, greedy()) for p in prompts]
    reqs = [eng.get_request(i) for i in ids]
    eng.step()
    assert len(eng.scheduler.running) == 8 and not eng.scheduler.waiting
    while eng.has_unfinished_requests():
        eng.step()
    _, want = cold_run(tiny, 0, prompts, sp)
    assert [r.output_token_ids for r in reqs] == [o.outputs[0].token_ids for o in want]


def cold_run(ckpt, k, prompts, params, **kw):
    cold = make(ckpt, k, caching=False, **kw)
    return cold, cold.generate(prompts, params, use_tqdm=False)


# Workloads -------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_shared_system_prompt_eight_questions(tiny, k, mode):
    """A 70-token system prompt (several blocks, a partial last one) and 8 questions: the first
    request caches it, the other 7 run together from the checkpoint before their question."""
    system = msg(70, 1)
    prompts = [system + question(6 + i, i) + [START, 5] for i in range(8)]
    params = ([greedy()] * 8 if mode == "greedy" else [sampled(100 + i) for i in range(8)])
    llm = make(tiny, k)
    outs = llm.generate(prompts[:1], params[:1], use_tqdm=False)
    outs += llm.generate(prompts[1:], params[1:], use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    # the batch's branch point is after the questions' common start token: a question admitted
    # once another has written that checkpoint resumes there
    assert all(len(system) <= o.num_cached_tokens <= len(system) + 1 for o in outs[1:])
    cold, want = cold_run(tiny, k, prompts, params)
    assert_same(outs, want)
    if k:
        assert_same_drafts(llm, cold, prompts)
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize("k", [0, 3])
def test_agent_history_branching_three_ways(tiny, k):
    """An agent's history (system, user, assistant call, tool result) run once, then three
    branches of it at once, each resuming from the end of the shared history."""
    history = msg(20, 1) + msg(30, 2) + msg(25, 3) + msg(40, 4)
    branches = [history + msg(8 + 3 * i, 20 + i) + [START, 5] for i in range(3)]
    llm = make(tiny, k)
    first = llm.generate([history + [START, 5]], greedy(), use_tqdm=False)
    outs = llm.generate(branches, greedy(), use_tqdm=False)
    assert first[0].num_cached_tokens == 0
    # the first request's checkpoint before its last token lies past the next message's start
    assert [o.num_cached_tokens for o in outs] == [len(history) + 1] * 3
    cold, want = cold_run(tiny, k, [history + [START, 5]] + branches, greedy())
    assert_same(first + outs, want)
    if k:
        assert_same_drafts(llm, cold, branches)


def rewrite(answer: list[int]) -> list[int]:
    """How the template renders an earlier answer in later turns: without its first two tokens
    (as Qwen3.5's drops a past think block)."""
    return [START] + answer[2:]


@pytest.mark.parametrize("k", [0, 3])
def test_six_turn_chat_whose_template_rewrites_history(tiny, k):
    """Each turn's prompt renders the earlier answers differently from how they were generated:
    it diverges where the previous answer began, and resumes from the checkpoint before it (the
    message start); on a session, as the chat command runs it."""
    llm = make(tiny, k)
    s = llm.open_session()
    rendered, prompts, outs, gen_start = msg(30, 1), [], [], 0
    for turn in range(6):
        rendered = rendered + msg(5 + turn, 10 + turn)
        prompt = rendered + [START, 5, 6]  # the generation prompt
        list(llm.stream_tokens(prompt, greedy(8), session=s, snapshot_at=len(rendered)))
        o = llm.last_stream_output
        prompts.append(prompt)
        outs.append(o)
        if turn:  # where the previous turn's generation prompt began
            assert o.num_cached_tokens == gen_start
        gen_start = len(rendered)
        rendered = rendered + rewrite(o.outputs[0].token_ids)
    llm.close_session(s)
    cold, want = cold_run(tiny, k, prompts, greedy(8))
    assert_same(outs, want)
    if k:
        assert_same_drafts(llm, cold, prompts)
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize("k", [0, 3])
def test_all_workloads_under_a_cache_that_evicts_and_preempts(tiny, k):
    """The three workloads at once in a cache a fraction of their size, admission control off
    so that requests are preempted: blocks and checkpoints are evicted, requests preempted and
    resumed from their own checkpoints, and every output is still the cold one."""
    system = msg(60, 1)
    history = system + msg(30, 2) + msg(25, 3)
    prompts = [system + msg(6 + i, 10 + i) + [START, 5] for i in range(6)]
    prompts += [history + msg(8 + 3 * i, 20 + i) + [START, 5] for i in range(3)]
    llm = tight(tiny, k, 16, 3, max_num_batched_tokens=32, max_model_len=160)
    llm.engine.scheduler.admission_control = False
    outs = llm.generate(prompts[:1], greedy(), use_tqdm=False)
    outs += llm.generate(prompts[1:], greedy(), use_tqdm=False)
    st = llm.engine.cache.prefix.stats
    assert llm.engine.stats["num_preemptions"] > 0
    assert st["block_evictions"] > 0 and st["checkpoint_evictions"] > 0 and st["hits"] > 0
    cold, want = cold_run(tiny, k, prompts, greedy())
    assert_same(outs, want)
    if k:
        assert_same_drafts(llm, cold, prompts)
    assert llm.engine.cache.all_free()


@pytest.mark.parametrize("k", [0, 3])
def test_requests_arriving_together_share_the_prefill(tiny, k):
    """Requests that arrive together wait for a running request that is prefilling their
    common prefix, and resume from its checkpoints instead of computing the same tokens beside
    it: the 8-question workload submitted at once, and the choices of an n = 4 request."""
    system = msg(70, 1)
    prompts = [system + question(6 + i, i) + [START, 5] for i in range(8)]
    llm = make(tiny, k)
    before = llm.engine.stats["num_prefill_tokens"]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    own = sum(len(p) - len(system) - 1 for p in prompts[1:])  # they share the next START too
    assert llm.engine.stats["num_prefill_tokens"] - before == len(prompts[0]) + own
    cold, want = cold_run(tiny, k, prompts, greedy())
    assert_same(outs, want)
    a = msg(60, 2)
    before = llm.engine.stats["num_prefill_tokens"]
    (joined,) = llm.generate([a], sampled(9).clone(n=4), use_tqdm=False)
    assert llm.engine.stats["num_prefill_tokens"] - before == len(a) + 3  # one token each
    _, alone = cold_run(tiny, k, [a] * 4, [sampled(9 + i) for i in range(4)])
    assert [c.token_ids for c in joined.outputs] == [o.outputs[0].token_ids for o in alone]


# The demo model: bf16 and int8, its chat template -----------------------------------------------
SYSTEM = ("You answer questions about the Python standard library in one or two sentences, "
          "naming the module and the function, and you say so when you are not sure. "
          "Prefer the functions of the standard library over third-party packages.")
QUESTIONS = ["What does json.dumps do?", "Which module provides deque?", "What does re.sub do?",
             "What is os.path.join for?", "What does shutil.copy do?", "What is a set?",
             "How do I read a file?", "What does itertools.chain do?"]


@pytest.mark.parametrize("quantization", [None, "int8"], ids=["bf16", "int8"])
@pytest.mark.parametrize("k", [0, 3])
def test_demo_model_shared_system_prompt(quantization, k):
    """The 8-question workload on the demo model through its chat template (bf16 and int8
    weights): the questions resume after the system message, and answer as a cold run does."""
    kw = {"max_model_len": 512, "max_num_seqs": 8, "cache_memory": 64 << 20,
          "speculative_tokens": k, "quantization": quantization}
    llm = LLM(**kw)
    cold = LLM(enable_prefix_caching=False, **kw)
    prompts = [llm.tokenizer.encode(llm.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]))
        for q in QUESTIONS]
    system_len = len(llm.tokenizer.encode(llm.apply_chat_template(
        [{"role": "system", "content": SYSTEM}], add_generation_prompt=False)))
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2)
    outs = llm.generate(prompts[:1], params, use_tqdm=False)
    outs += llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs[1:]] == [system_len] * 7
    want = cold.generate(prompts, params, use_tqdm=False)
    # bf16 products over a different split of rows round differently (on the fma path a row
    # of a long prompt chunk and of a short one take different kernels): tokens equal,
    # logprobs to bf16's rounding (up to 0.051 measured)
    assert_same(outs, want, atol=0.1)
    llm.engine.cache.check()


# Where checkpoints are written --------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_checkpoint_inside_a_prompt_chunk(tiny, backend):
    """A checkpoint in the middle of a step's prompt chunk is written during the forward (the
    GDN layers run the chunk in two rounds and save the state between them: the CPU compiled
    call and the reference's chunked form); a prompt that shares only that much resumes there
    and computes what a cold run does."""
    llm = make(tiny, backend=backend, checkpoint_interval=24)
    a = msg(59, 1)  # 60 tokens, one 64-token chunk: the checkpoints at 24 and 48 are inside it
    llm.generate([a], greedy(), use_tqdm=False)
    b = a[:30] + msg(9, 2)
    assert llm.engine.cached_tokens(b) == 24
    out = llm.generate([b], greedy(), use_tqdm=False)
    assert out[0].num_cached_tokens == 24
    _, want = cold_run(tiny, 0, [b], greedy(), backend=backend)
    assert_same(out, want)


def test_checkpoint_positions_policy():
    prompt = [5, START, 7, 8, START, 9, 9, 9, 9, 9, START, 4]
    assert checkpoint_positions(prompt, {START}, 0) == [1, 4, 10, 11]
    assert checkpoint_positions(prompt, {START}, 3) == [1, 3, 4, 6, 9, 10, 11]
    assert checkpoint_positions(prompt, set(), 0, requested=[2, 40]) == [2, 11]
    assert checkpoint_positions([5], {START}, 4) == []


# Regression tests: the bugs other engines' users reported -----------------------------------------
@pytest.mark.parametrize("k", [0, 3])
def test_hit_that_ends_exactly_on_a_block_boundary(tiny, k):
    """A checkpoint at position 32, a block boundary: with k = 0 every block before it is
    shared and nothing is copied; with the MTP the block before it is copied and its last MTP
    KV rewritten from the new prompt's token 32, which differs from the one it was cached with
    (the drafts show it)."""
    a = msg(31, 1) + msg(20, 2)  # the second message starts at 32
    b = a[:32] + [9] + msg(14, 3)[1:]  # the token at 32 differs: the MTP KV at 31 must too
    assert a[32] == START != b[32]
    llm = make(tiny, k)
    llm.generate([a], greedy(), use_tqdm=False)
    out = llm.generate([b], greedy(), use_tqdm=False)
    assert out[0].num_cached_tokens == 32
    cold, want = cold_run(tiny, k, [b], greedy())
    assert_same(out, want)
    if k:
        assert_same_drafts(llm, cold, [b])


@pytest.mark.parametrize("k", [0, 3])
def test_hit_that_leaves_a_one_token_tail(tiny, k):
    """The same prompt again resumes before its last token and computes just that one: its
    first token, logprobs and drafts are the cold run's (sglang #29633 corrupted it)."""
    a = msg(44, 1)
    llm = make(tiny, k)
    first = llm.generate([a], sampled(3), use_tqdm=False)
    again = llm.generate([a], sampled(3), use_tqdm=False)
    assert again[0].num_cached_tokens == len(a) - 1
    assert again[0].metrics["num_prefilled_tokens"] == 1
    cold, want = cold_run(tiny, k, [a], sampled(3))
    assert_same(first, want)
    assert_same(again, want)


def test_hit_whose_last_block_held_draft_tokens(tiny):
    """A request that speculated finished with drafts written past its last computed token in
    its last block (the target's verification KV and the MTP's lookahead KV); a continuation of
    its conversation resumes at its end and must see only the computed positions of that block
    (vllm #53912: a lookahead block reused)."""
    k = 3
    llm = make(tiny, k)
    a = msg(37, 1)
    o = llm.generate([a], greedy(13), use_tqdm=False)[0]
    answer = o.outputs[0].token_ids
    done = len(a) + len(answer) - 1
    assert done % 16 and llm.engine.spec_stats.num_draft_tokens > 0
    b = a + answer + msg(5, 2)
    assert llm.engine.cached_tokens(b) == done
    out = llm.generate([b], greedy(), use_tqdm=False)
    cold, want = cold_run(tiny, k, [b], greedy())
    assert_same(out, want)
    assert_same_drafts(llm, cold, [b])


def test_mtp_blocks_are_hashed_with_the_token_after_them(tiny):
    """The MTP layer's KV at a block's last position was computed from the token after the
    block. P and Q share blocks 0 and 1 (tokens 0-31) but not token 32; H continues Q past a
    checkpoint at 40. Were blocks hashed by their own tokens only, H would share P's block 1
    (registered first) and draft from P's MTP KV at position 31; hashed with token 32 too, it
    shares Q's, and its drafts are the cold run's."""
    k = 3
    base = msg(31, 1)  # tokens 0-31
    p_ = base + [7] * 20
    q = base + [9] * 8 + msg(12, 3)  # a message starts at 40: a checkpoint there
    h = q[:41] + msg(10, 4)
    assert q[40] == START and p_[32] != q[32]
    llm = make(tiny, k)
    llm.generate([p_], greedy(), use_tqdm=False)
    llm.generate([q], greedy(), use_tqdm=False)
    cache = llm.engine.cache
    hp, hq = (cache.block_hashes(mtp=True).upto(t, 2) for t in (p_, q))
    assert hp[0] == hq[0] and hp[1] != hq[1]
    plain = [cache.block_hashes(mtp=False).upto(t, 2) for t in (p_, q)]
    assert plain[0] == plain[1]  # a request that does not speculate shares either
    out = llm.generate([h], greedy(), use_tqdm=False)
    assert out[0].num_cached_tokens == 40
    cold, want = cold_run(tiny, k, [h], greedy())
    assert_same(out, want)
    assert_same_drafts(llm, cold, [h])


def test_checkpoint_is_restored_in_the_state_dtype(tiny):
    """A checkpoint is a slot of the same state tensors: the recurrent state stays fp32 in a
    bf16 model (sglang #33515 restored it in bf16), and the checkpoint a hit restores is bit for
    bit the state a cold request has after the same tokens."""
    a = msg(40, 1) + msg(3, 3)
    b = a[:41] + msg(10, 2)  # resumes at the message start at 41
    llm = make(tiny, dtype="bfloat16")
    cache = llm.engine.cache
    t = cache.tensors
    assert t.ssm_states.dtype == torch.float32 and t.conv_states.dtype == torch.bfloat16
    llm.generate([a], greedy(), use_tqdm=False)
    hit = cache.peek(b, cache.block_hashes(mtp=False))
    assert hit.num_tokens == 41
    slot = hit.checkpoint.slot
    # the cold state after the same 41 tokens: a first step of exactly 41 tokens
    cold = make(tiny, caching=False, dtype="bfloat16", max_num_batched_tokens=41)
    ce = cold.engine
    rid = ce.add_request(b, greedy(1))
    ce.step()
    assert ce.get_request(rid).num_computed_tokens == 41
    cslot = ce.cache.state_slot(rid)
    assert torch.equal(t.ssm_states[:, slot], ce.cache.tensors.ssm_states[:, cslot])
    assert torch.equal(t.conv_states[:, slot], ce.cache.tensors.conv_states[:, cslot])
    ce.abort_request(rid)
    out = llm.generate([b], greedy(), use_tqdm=False)
    assert out[0].num_cached_tokens == 41
    _, want = cold_run(tiny, 0, [b], greedy(), dtype="bfloat16")
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in want]


def test_evicted_block_id_reused_while_a_hash_pointed_at_it(tiny):
    """A cached block is evicted when its id is handed out again: the index forgets its hash
    first, so a later prompt with the old tokens cannot map to the block's new content."""
    llm = make(tiny, max_model_len=64)
    cfg = llm.config
    sizing = plan_cache(cfg, 64, 2, 16, torch.float32, memory_bytes=24 << 20)
    cache = HybridCacheManager(cfg, sizing, torch.float32, prefix_caching=True)
    h = cache.block_hashes(mtp=False)
    tokens = list(range(3, 3 + 33))
    got = cache.admit("a", tokens, h, 1, lambda hit: 33)
    assert got.num_tokens == 0
    cache.release("a", tokens, h, 32, keep_slot=0)  # 2 full blocks cached + a checkpoint at 32
    assert cache.peek(tokens + [7], cache.block_hashes(mtp=False)).num_tokens == 32
    old = cache.block_table  # nothing held now; allocate every block: the cached ones go
    n = sizing.num_blocks
    assert cache.allocate_blocks("b", n * 16)
    assert cache.prefix.stats["block_evictions"] == 2 and not cache.prefix.hash_of
    assert cache.peek(tokens + [7], cache.block_hashes(mtp=False)) is None
    cache.check()
    cache.release("b")
    assert cache.all_free() and old is not None


@pytest.mark.parametrize("k", [0, 3])
def test_references_after_abort_and_preemption(tiny, k):
    """Every block's reference count equals its holders after every step (``make`` checks),
    through hits, aborts mid-prompt and mid-answer, and preemptions; at the end nothing is
    held and the cached prefixes still hit."""
    system = msg(50, 1)
    prompts = [system + msg(10 + i, 10 + i) + [START, 5] for i in range(6)]
    llm = tight(tiny, k, 9, 4, max_num_batched_tokens=16, max_model_len=128)
    eng = llm.engine
    eng.scheduler.admission_control = False
    llm.generate(prompts[:1], greedy(), use_tqdm=False)
    rids = [eng.add_request(p, greedy(40)) for p in prompts[1:]]
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 2:
            eng.abort_request(rids[0])  # mid-prompt
        if steps == 12:
            eng.abort_request(rids[1])  # mid-answer, or later
    assert eng.stats["num_preemptions"] > 0
    for r in rids:
        eng.pop_request(r)
    cache = eng.cache
    assert cache.all_free() and not cache.owners() and not any(cache._blocks.refs)
    assert eng.cached_tokens(prompts[2]) > 0
