"""Prefix-aware routing's plain parts (hybridrt/prefix_routing.py, no Ray): a replica's summary
against what its engine would reuse, the router's table (reports, what it sent, forgetting),
and the rule that ranks replicas. The Ray deployment around them: tests/test_serve_ray.py."""

from __future__ import annotations

import random

import pytest

from hybridrt import LLM, SamplingParams
from hybridrt.prefix_routing import (
    ANCHOR_BYTES,
    PrefixTable,
    prompt_chain,
    rank,
    replica_summary,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _demo(k: int) -> LLM:
    return LLM(max_model_len=512, max_num_seqs=4, cache_memory=32 << 20, speculative_tokens=k)


def _chat(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.tokenizer.encode(llm.apply_chat_template(messages), add_special_tokens=False)


@pytest.mark.parametrize("k", [0, 1], ids=["k0", "mtp"])
def test_summary_matches_what_the_engine_would_reuse(k):
    """After a two-turn conversation on engine A, A's summary gives the third turn's prompt a
    match within one block of what A's engine would reuse of it (its own look-up), and the
    summary of an engine that never saw it gives none."""
    a, b = _demo(k), _demo(k)
    msgs = [{"role": "system", "content": "You answer in one sentence."}]
    for q in ["What does json.dumps do?", "And json.loads?"]:
        msgs.append({"role": "user", "content": q})
        (out,) = a.generate([_chat(a, msgs)], GREEDY, use_tqdm=False)
        msgs.append({"role": "assistant", "content": out.outputs[0].text})
    msgs.append({"role": "user", "content": "Which module provides deque?"})
    ids = _chat(a, msgs)
    table = PrefixTable()
    for name, llm in (("a", a), ("b", b)):
        summary = replica_summary(llm.engine)
        assert summary["lookahead"] == (1 if k else 0)
        assert len(summary["anchors"]) % ANCHOR_BYTES == 0
        # at most one anchor a state slot, whatever the context length
        assert len(summary["anchors"]) // ANCHOR_BYTES <= llm.engine.cache.sizing.num_slots
        table.report(name, summary)
    root, bs, lookahead = table.chain_params("a")
    chain = prompt_chain(ids, root, bs, lookahead)
    own = a.engine.cache.block_hashes(mtp=k > 0)
    assert chain == [h[:ANCHOR_BYTES] for h in own.upto(ids, own.num_hashable(len(ids) - 1))]
    reused = a.engine.cached_tokens(ids)
    matched = table.matched_blocks("a", chain)
    assert reused > 4 * bs  # the previous turns
    assert matched * bs <= reused < (matched + 1) * bs
    assert table.matched_blocks("b", chain) == 0 and b.engine.cached_tokens(ids) == 0


def test_summary_leaves_out_checkpoints_whose_blocks_are_gone():
    """A checkpoint whose anchor block was evicted cannot be resumed from (the engine's look-up
    stops at the first missing block): it is not reported; nor is anything after a reset."""
    llm = _demo(0)
    ids = _chat(llm, [{"role": "system", "content": "Be brief. " * 8},
                      {"role": "user", "content": "What does json.dumps do?"}])
    llm.generate([ids], GREEDY, use_tqdm=False)
    index = llm.engine.cache.prefix
    assert replica_summary(llm.engine)["anchors"] and index.checkpoints
    for block in list(index.hash_of):  # the blocks' eviction, the checkpoints kept
        index.forget_block(block)
    assert index.checkpoints and replica_summary(llm.engine)["anchors"] == b""
    assert llm.engine.cached_tokens(ids) < index.block_size
    llm.generate([ids], GREEDY, use_tqdm=False)
    assert replica_summary(llm.engine)["anchors"]
    assert llm.reset_prefix_cache()
    assert replica_summary(llm.engine)["anchors"] == b""


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _summary(hashes: list[bytes]) -> dict:
    return {"root": b"r" * 16, "block_size": 16, "lookahead": 0, "anchors": b"".join(hashes)}


def test_table_matches_the_longest_reported_or_recently_sent_block():
    clock = Clock()
    table = PrefixTable(recent_ttl=10.0, clock=clock)
    chain = [bytes([i]) * ANCHOR_BYTES for i in range(6)]
    assert table.chain_params("a") is None  # nothing reported yet: no chain to compute
    table.report("a", _summary([chain[1], chain[3], b"x" * ANCHOR_BYTES]))
    assert table.chain_params("b") == table.chain_params("a")  # a replica not yet reported
    assert table.matched_blocks("a", chain) == 4  # block 3 (0-based) is the last anchor
    assert table.matched_blocks("a", chain[:3]) == 2
    assert table.matched_blocks("b", chain) == 0
    table.routed("b", chain[:5])
    assert table.matched_blocks("b", chain) == 5  # sent there: held there for a while
    clock.now = 10.5
    assert table.matched_blocks("b", chain) == 0  # until its report has had time to come
    table.report("a", _summary([chain[0]]))  # a newer report replaces the old one
    assert table.matched_blocks("a", chain) == 1
    table.forget("a")
    assert table.matched_blocks("a", chain) == 0


def test_table_keeps_at_most_max_recent_blocks_a_replica():
    table = PrefixTable(max_recent=3)
    chain = [bytes([i]) * ANCHOR_BYTES for i in range(5)]
    table.routed("a", chain)
    assert table.matched_blocks("a", chain[:2]) == 0  # the oldest went first
    assert table.matched_blocks("a", chain) == 5


def test_rank_prefers_the_holder_unless_it_is_overloaded():
    loads = {"a": 3, "b": 0, "c": 1}
    # the holder of the longest match, even with more requests than the others
    ranks, why = rank(["a", "b", "c"], {"a": 5, "c": 2}, loads, max_imbalance=4)
    assert (ranks, why) == ([["a"], ["b", "c"]], "prefix")
    # past the imbalance: the least loaded first
    ranks, why = rank(["a", "b", "c"], {"a": 5}, {**loads, "a": 5}, max_imbalance=4)
    assert (ranks, why) == ([["b", "c", "a"]], "overloaded")
    # exactly at it: still the holder
    assert rank(["a", "b"], {"a": 5}, {"a": 4, "b": 0}, max_imbalance=4)[1] == "prefix"
    # nothing matched: least loaded
    assert rank(["a", "b", "c"], {}, loads, 4) == ([["b", "c", "a"]], "least_loaded")
    # a replica whose load is unknown (it did not answer) comes last, never first
    ranks, why = rank(["a", "b"], {"a": 9}, {"a": None, "b": 2}, 4)
    assert (ranks, why) == ([["b"], ["a"]], "least_loaded")


def test_rank_spreads_ties():
    """Holders of the same match with the same load share the first rank, in random order;
    so do idle replicas with nothing matched."""
    rng = random.Random(0)
    firsts = {rank(["a", "b", "c"], {"a": 2, "b": 2}, {"a": 1, "b": 1, "c": 0}, 4, rng)[0][0][0]
              for _ in range(50)}
    assert firsts == {"a", "b"}
    firsts = {rank(["a", "b"], {}, {"a": 0, "b": 0}, 4, rng)[0][0][0] for _ in range(50)}
    assert firsts == {"a", "b"}
