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
    assert set(rows) == {label for label, _, _ in policybench.POLICIES}
    prompt, system = 75 + 3 + 2, 75  # system, question, generation-prompt start + one token
    for label in ("messages + 2048 (default)", "messages only", "messages + 512"):
        r = rows[label]
        assert r["query_tokens"] == 16 * prompt
        assert r["prefilled"] == prompt + 15 * (prompt - system)  # all but the first resume
        assert r["hit_rate"] == 15 * system / (16 * prompt)
    for label in ("2048 only", "512 only"):  # no message checkpoints, no interval reached
        assert rows[label]["prefilled"] == 16 * prompt and rows[label]["hit_rate"] == 0
        assert rows[label]["checkpoints_saved"] < rows["messages only"]["checkpoints_saved"]
    assert (tmp_path / "r.json").exists()
    assert "| shared | messages only | 1280 | 155 |" in policybench.table(rep)


def test_prefix_policy_refuses_an_unknown_workload():
    r = subprocess.run([sys.executable, "-m", "hybridrt", "bench", "prefix-policy",
                        "--workloads", "chat,nope"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--workloads: unknown workload(s) ['nope']" in r.stderr
