"""The prefix cache's disk tier (statecache/disk.py, statecache/tiering.py): an engine started
on the directory another one wrote resumes a conversation without prefilling it again, and
answers bit for bit as the engine that never stopped (batch-invariant mode); a file that is
truncated, bit-flipped or another model's is skipped with a log line and the answer is still
exact; evicted entries spill to the directory and come back; the directory keeps to its size.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.statecache.disk import MAGIC, DiskTier

TINY = tiny_text_config()
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("disk"), TINY, seed=21)


def make(ckpt, directory=None, k=0, dtype="float32", **kw) -> LLM:
    kw = {"dtype": dtype, "max_model_len": 512, "max_num_seqs": 4, "cache_memory": 32 << 20,
          "max_num_batched_tokens": 64, "speculative_tokens": k, "batch_invariant": True,
          "prefix_cache_dir": None if directory is None else str(directory), **kw}
    return LLM(ckpt, **kw)


def message(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist()


def converse(llm, turns, history=None):
    """Run ``turns`` (their new messages) as a conversation from ``history`` -> (the history
    after, the outputs)."""
    history, outs = list(history or []), []
    for t in turns:
        prompt = history + t
        (out,) = llm.generate([prompt], PARAMS, use_tqdm=False)
        outs.append(out)
        history = prompt + list(out.outputs[0].token_ids)
    return history, outs


TURNS = [message(40 + 7 * i, 300 + i) for i in range(6)]


def assert_bits(got, want):
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].logprobs == w.outputs[0].logprobs  # bit for bit


def unrestarted(ckpt, k=0, dtype="float32"):
    _, outs = converse(make(ckpt, k=k, dtype=dtype), TURNS)
    return outs


@pytest.mark.parametrize(("k", "dtype"), [(0, "float32"), (2, "bfloat16")])
def test_a_restarted_engine_resumes_the_conversation(tiny, tmp_path, k, dtype):
    """Turns 1-3 on one engine, turns 4-6 on a new engine on the same directory: turn 4 resumes
    where turn 3 ended (as the unrestarted engine does) and every answer is bit for bit the
    unrestarted engine's."""
    want = unrestarted(tiny, k, dtype)
    first = make(tiny, tmp_path, k, dtype)
    history, outs = converse(first, TURNS[:3])
    assert first.engine.cache.disk.stats["disk_checkpoint_writes"] >= 3
    del first
    second = make(tiny, tmp_path, k, dtype)
    _, later = converse(second, TURNS[3:], history)
    assert later[0].num_cached_tokens == want[3].num_cached_tokens >= len(history) - 1
    assert second.engine.cache.prefix.stats["disk_hit_tokens"] >= len(history) - 1
    assert_bits(outs + later, want)


def _last_checkpoint(disk: DiskTier):
    return max(disk.checkpoints.values(), key=lambda c: c.num_tokens)


def _rewrite(path, edit_header=None, edit_payload=None):
    raw = path.read_bytes()
    (n,) = struct.unpack("<I", raw[len(MAGIC):len(MAGIC) + 4])
    header = json.loads(raw[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    payload = bytearray(raw[len(MAGIC) + 4 + n:])
    if edit_header:
        edit_header(header)
    if edit_payload:
        payload = edit_payload(payload)
    head = json.dumps(header).encode()
    path.write_bytes(MAGIC + struct.pack("<I", len(head)) + head + bytes(payload))


def _flip(payload: bytearray) -> bytearray:
    payload[len(payload) * 2 // 3] ^= 0x40
    return payload


@pytest.mark.parametrize("damage", ["truncated", "flipped checkpoint", "flipped block"])
def test_a_damaged_file_is_skipped_and_the_answer_stays_exact(tiny, tmp_path, caplog, damage):
    want = unrestarted(tiny)
    first = make(tiny, tmp_path)
    history, _ = converse(first, TURNS[:3])
    disk = first.engine.cache.disk
    last = _last_checkpoint(disk)
    if damage == "truncated":
        path = tmp_path / last.name
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "flipped checkpoint":
        _rewrite(tmp_path / last.name, edit_payload=_flip)
    else:  # the conversation's last full block before the checkpoint
        h = first.engine.cache.block_hashes(False).upto(history, last.num_shared)[-1]
        _rewrite(tmp_path / disk.block_name(h), edit_payload=_flip)
    del first
    second = make(tiny, tmp_path)
    with caplog.at_level("WARNING", logger="hybridrt.prefix_disk"):
        _, later = converse(second, TURNS[3:], history)
    assert "prefix cache: skipped" in caplog.text
    assert second.engine.cache.disk.stats["disk_bad_files"] == 1
    assert later[0].num_cached_tokens < want[3].num_cached_tokens
    assert_bits(later, want[3:])


def test_another_models_file_is_never_loaded(tiny, tmp_path, tmp_path_factory, caplog):
    """A checkpoint written by another model (other weights, the same shapes), put where this
    model's checkpoint would be, its header naming the key this model looks up: it is skipped
    (its identity is not this cache's) and the answer stays exact."""
    want = unrestarted(tiny)
    other = write_random_checkpoint(tmp_path_factory.mktemp("other"), TINY, seed=22)
    first = make(tiny, tmp_path)
    history, _ = converse(first, TURNS[:3])
    ours = _last_checkpoint(first.engine.cache.disk)
    foreign_dir = tmp_path_factory.mktemp("foreign")
    foreign = make(other, foreign_dir)
    converse(foreign, TURNS[:3])
    theirs = _last_checkpoint(foreign.engine.cache.disk)
    assert theirs.num_tokens == ours.num_tokens
    target = tmp_path / ours.name
    target.write_bytes((foreign_dir / theirs.name).read_bytes())

    def as_ours(header):
        header.update(name=ours.name, anchor=ours.anchor.hex(), tail=list(ours.tail))

    _rewrite(target, edit_header=as_ours)
    del first, foreign
    with caplog.at_level("WARNING", logger="hybridrt.prefix_disk"):
        second = make(tiny, tmp_path)
        _, later = converse(second, TURNS[3:], history)
    assert_bits(later, want[3:])
    assert "another model's or format's file" in caplog.text
    assert second.engine.cache.prefix.stats["disk_hit_tokens"] < ours.num_tokens


def test_evicted_entries_spill_and_come_back(tiny, tmp_path):
    """A cache too small to keep a conversation beside three long requests (two state slots,
    64 blocks): the conversation's blocks and checkpoints are evicted, spilled to the
    directory, and its next turn is restored from there, exactly."""
    small = {"cache_memory": None, "max_num_seqs": 2, "checkpoint_share": 0.0}
    llm = make(tiny, tmp_path, **small)
    cold = make(tiny, None, **small, enable_prefix_caching=False)
    a_hist, _ = converse(llm, TURNS[:2])
    for i in range(3):
        converse(llm, [message(300, 900 + i)])
    assert llm.engine.cache.peek(a_hist + TURNS[2], llm.engine.cache.block_hashes(False)) is None
    (out,) = llm.generate([a_hist + TURNS[2]], PARAMS, use_tqdm=False)
    st = llm.engine.cache.disk.stats
    assert out.num_cached_tokens >= len(a_hist) - 1
    assert st["disk_checkpoint_restores"] >= 1
    (want,) = cold.generate([a_hist + TURNS[2]], PARAMS, use_tqdm=False)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_the_directory_keeps_to_its_size(tmp_path):
    disk = DiskTier(tmp_path, "m", max_bytes=3000)
    for i in range(5):
        disk.put(disk.block_name(bytes([i]) * 16), {"k0": torch.zeros(200)})
    assert disk.bytes <= 3000 and disk.stats["disk_evictions"] >= 1
    assert not disk.has_block(bytes([0]) * 16) and disk.has_block(bytes([4]) * 16)
    again = DiskTier(tmp_path, "m", max_bytes=3000)  # indexes what is there
    assert again.blocks == disk.blocks and again.bytes == disk.bytes
    assert not DiskTier(tmp_path, "another", max_bytes=3000).blocks


def test_options_refused():
    with pytest.raises(ValueError, match="needs enable_prefix_caching=True"):
        LLM(enable_prefix_caching=False, prefix_cache_dir="/tmp/x")
    with pytest.raises(ValueError, match="prefix_cache_dir_size must be bytes"):
        LLM(prefix_cache_dir="/tmp/x", prefix_cache_dir_size="lots")


def test_a_restarted_server_resumes_the_chat_and_counts_it(tmp_path):
    """The demo model served with a disk tier: a 6-turn chat, the server restarted on the same
    directory after turn 3. Turn 4 reuses as many tokens as on a server that never stopped, and
    every answer is the same; /metrics counts the disk tier's writes, restores and hits."""
    pytest.importorskip("uvicorn")
    from test_serve import MODEL, Running

    questions = ["Name a prime.", "And another?", "Which is larger?", "Add them.",
                 "Is the sum prime?", "Thanks."]
    kw = {"dtype": "float32", "max_model_len": 1024, "max_num_seqs": 4,
          "cache_memory": 64 << 20, "batch_invariant": True}

    def chat(srv, history, q):
        history.append({"role": "user", "content": q})
        r = srv.client.chat.completions.create(model=MODEL, messages=history, temperature=0,
                                               max_tokens=12)
        history.append({"role": "assistant", "content": r.choices[0].message.content})
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    def run(srv, turns, history):
        got = [chat(srv, history, q) for q in turns]
        metrics = srv.wait_idle()
        srv.stop()
        return got, metrics

    want, _ = run(Running(LLM(**kw)), questions, [])
    history = []
    got, _ = run(Running(LLM(**kw, prefix_cache_dir=str(tmp_path))), questions[:3], history)
    later, metrics = run(Running(LLM(**kw, prefix_cache_dir=str(tmp_path))), questions[3:],
                         history)
    assert got + later == want  # the answers, and the tokens reused each turn
    assert want[3][1] > 0
    assert metrics["hybridrt_prefix_cache_disk_hits_total"] == 1
    assert metrics["hybridrt_prefix_cache_disk_restores_total"] >= 1
    assert metrics["hybridrt_prefix_cache_disk_spills_total"] >= 3
    assert metrics["hybridrt_prefix_cache_disk_checkpoints"] >= 3


def test_the_restart_bench_shows_the_resumed_turn_and_the_skipped_files(tiny):
    """``hybridrt bench prefix --workloads restart`` (each part in a process of its own): the
    turn after the restart resumes from disk as far as the unrestarted run resumes from memory,
    and prefills only its own message; damaged checkpoint files are skipped with a log line;
    every answer is bit for bit the unrestarted run's."""
    from hybridrt.bench import prefix_restart

    rep = prefix_restart.run(str(tiny), message_tokens=30, max_tokens=4, verbose=False,
                             engine={"dtype": "float32", "max_model_len": 512,
                                     "cache_memory": 32 << 20})
    whole, restarted = rep["unrestarted"], rep["restarted"]
    assert rep["same_as_unrestarted"]
    assert restarted[3]["cached_tokens"] == whole[3]["cached_tokens"]
    assert restarted[3]["prefilled_tokens"] <= 30 + 1 < restarted[3]["prompt_tokens"] // 3
    assert rep["restarted_disk_hit_tokens"] >= restarted[3]["cached_tokens"] > 0
    for how, d in rep["damaged"].items():
        assert d["same_as_unrestarted"], how
        assert any("prefix cache: skipped" in line for line in d["log"]), (how, d["log"])
        assert d["turn_after"]["cached_tokens"] < whole[3]["cached_tokens"], how
    assert "bit for bit as unrestarted: True" in prefix_restart.table(rep)
