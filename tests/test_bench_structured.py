"""``hybridrt bench structured``: decode-step times with and without a JSON schema per batch,
and the schema's compile times (a cached compile far below the first)."""

from __future__ import annotations

import pytest

from hybridrt.bench import structured as structuredbench

pytest.importorskip("llguidance")


def test_structured_bench_reports_both_modes_per_batch(tmp_path):
    rep = structuredbench.run(None, threads=1, batches=(1, 2), rounds=1, tokens=4,
                              cpu_time=True, json_path=tmp_path / "r.json", verbose=False)
    assert rep["clock"] == "cpu" and set(rep["batches"]) == {1, 2}
    for r in rep["batches"].values():
        assert r["decode_step_ms_off"] > 0 and r["decode_step_ms_on"] > 0
        assert r["ratio"] == r["decode_step_ms_on"] / r["decode_step_ms_off"]
        # 4 tokens each: the first comes from the prefill step, 3 decode steps
        assert [steps for _, steps in r["rounds_on"]] == [3]
    assert rep["compile_cached_s"] < rep["compile_first_s"]
    assert (tmp_path / "r.json").exists()
    assert "| 2 |" in structuredbench.table(rep)
