"""``hybridrt bench prefix-policy``: on the shared workload, a checkpoint at message starts saves
exactly the system message for every request after the first, a token interval beyond the
prompts saves nothing, and a bad workload name is one line."""

from __future__ import annotations

import subprocess
import sys

from hybridrt.bench import prefix_policy as policybench


def test_prefix_policy_counts_what_each_placement_saves(tmp_path):
    rep = policybench.run(None, threads=1, scale=0.05, max_tokens=2, cache_memory="256MiB",
                          max_model_len=512, chosen=("shared",), json_path=tmp_path / "r.json",
                          verbose=False)
    rows = {r["placement"]: r for r in rep["rows"]}
    assert set(rows) == {label for label, *_ in policybench.POLICIES}
    prompt, system = 75 + 3 + 2, 75  # system, question, generation-prompt start + one token
    for label, messages, _, found in policybench.POLICIES:
        r = rows[label]
        assert r["query_tokens"] == 16 * prompt
        if found:  # all but the first resume after the system and the question's start token
            assert r["prefilled"] == prompt + 15 * (prompt - system - 1), label
        elif messages:  # all but the first resume after the system message
            assert r["prefilled"] == prompt + 15 * (prompt - system), label
        else:  # no message checkpoints, no interval reached
            assert r["prefilled"] == 16 * prompt and r["hit_rate"] == 0
    assert (tmp_path / "r.json").exists()
    assert "| shared | messages only | 1280 | 140 |" in policybench.table(rep)


def test_raw_prompts_one_after_another_resume_at_the_cached_blocks_end():
    """7 raw prompts sharing 280 tokens, one after another: the second resumes at the lead-in
    checkpoint (256), the rest where the cached blocks end (272); before branch points and the
    lead-in, none resumed."""
    rep = policybench.run(None, threads=1, scale=0.4, max_tokens=2, cache_memory="256MiB",
                          max_model_len=512, chosen=("raw",), verbose=False)
    rows = {r["placement"]: r for r in rep["rows"]}
    prompt = 280 + 8
    assert rows["messages + 2048 (default)"]["prefilled"] == prompt + (prompt - 256) + 5 * (
        prompt - 272)
    assert rows["today's: messages + 2048"]["prefilled"] == 7 * prompt


def test_prefix_policy_refuses_an_unknown_workload():
    r = subprocess.run([sys.executable, "-m", "hybridrt", "bench", "prefix-policy",
                        "--workloads", "chat,nope"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--workloads: unknown workload(s) ['nope']" in r.stderr
