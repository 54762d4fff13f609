"""``hybridrt bench steps``: the report times every decode step's compiled calls per weight kind
and batch (the layers in one call, or each kernel with --no-program), leaves the kernels
unwrapped after the run, and refuses a bad weight kind in one line."""

from __future__ import annotations

import subprocess
import sys

from hybridrt.bench import steps as stepsbench
from hybridrt.kernels import native


def test_steps_bench_reports_each_call_per_kind_and_batch(tmp_path):
    original = native.gdn_fused
    rep = stepsbench.run(None, batches=(1, 2), steps=2, rounds=1, threads=1,
                         quantizations=(None, "int8"), cache_memory="64MiB", max_model_len=128,
                         json_path=tmp_path / "r.json", verbose=False)
    assert native.gdn_fused is original  # the timers are gone
    assert set(rep["weights"]) == {"bfloat16", "int8"} and rep["batches"] == [1, 2]
    for w in rep["weights"].values():
        assert set(w["step_ms"]) == {1, 2} and all(ms > 0 for ms in w["step_ms"].values())
        assert w["calls"]["LM head (logits)"]["per_step"] == 1
    assert rep["weights"]["bfloat16"]["calls"]["layers (one call)"]["per_step"] == 1
    assert "int8 products" in rep["weights"]["int8"]["calls"]
    assert (tmp_path / "r.json").exists()
    text = stepsbench.table(rep)
    assert "bfloat16 weights" in text and "int8 weights" in text and "x b1 tok/s" in text


def test_steps_bench_without_the_step_program_times_each_kernel():
    rep = stepsbench.run(None, batches=(1,), steps=2, rounds=1, threads=1, no_program=True,
                         cache_memory="64MiB", max_model_len=128, verbose=False)
    calls = rep["weights"]["bfloat16"]["calls"]
    assert "layers (one call)" not in calls and not rep["step_program"]
    assert calls["gdn_fused"]["per_step"] == 6 and calls["attn_decode"]["per_step"] == 2
    assert "gemv_bf16" in calls


def test_steps_bench_refuses_an_unknown_weight_kind():
    r = subprocess.run([sys.executable, "-m", "hybridrt", "bench", "steps", "--weights",
                        "int8,int3"], capture_output=True, text=True)
    assert r.returncode == 2
    assert "--weights: unknown kind(s) ['int3']" in r.stderr
