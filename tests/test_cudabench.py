"""``python -m hybridrt.bench.cuda`` dry-run on the CPU (``--device cpu --tiny``): every part of
the GPU benchmark's code runs and writes its report (the figures mean nothing here)."""

from __future__ import annotations

import json
import time

import pytest

from hybridrt.bench import cuda as cudabench


def test_cpu_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "bench.json"
    report = cudabench.main([
        "--device", "cpu", "--tiny", "--dtype", "float32", "--cache-memory", "64MiB",
        "--batches", "1,2", "--prefill", "24,40", "--prompt-len", "8", "--decode-tokens", "6",
        "--repeats", "1", "--phase-batches", "1,2", "--phase-steps", "3", "--profile-steps", "3",
        "--async-scheduling", "on", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    ours = report["ours"]
    for key in ("decode_b1_tok_s", "decode_b2_tok_s", "prefill_24_tok_s", "prefill_40_tok_s"):
        assert ours[key] > 0, key
    assert ours["backend"] == "cpu"
    assert ours["async_scheduling"] and ours["num_chained_steps"] > 0
    assert ours["decode_b1_sync_tok_s"] > 0 and ours["decode_b2_sync_tok_s"] > 0
    for b in ("b1", "b2"):
        phases = ours["phases"][b]
        parts = ("schedule", "prepare", "forward", "logits", "sample", "update")
        # chained steps (async scheduling) skip the scheduler
        assert all(phases[p] > 0 for p in parts[1:]) and phases["schedule"] >= 0, phases
        assert phases["sum"] == pytest.approx(sum(phases[p] for p in parts))
        assert phases["forward"] > phases["update"]
    prof = ours["profile"]
    assert set(prof) == {"decode_b1", "prefill_24"}
    assert prof["decode_b1"]["steps"] == 3 and prof["decode_b1"]["host_us_per_step"] > 0
    assert prof["decode_b1"]["kernels_per_step"] == 0  # no device here
    assert prof["prefill_24"]["top"] and all(r["calls"] > 0 for r in prof["prefill_24"]["top"])
    roof = report["roofline"]
    assert roof["copy_bytes_per_s"] > 0
    assert roof["decode_b1_ceiling_tok_s"] == pytest.approx(
        roof["copy_bytes_per_s"] / ours["weight_bytes"])
    tf = report["transformers"]
    assert "error" not in tf, tf
    assert tf["decode_b1_tok_s"] > 0 and tf["prefill_40_tok_s"] > 0


def test_phase_timer_adds_each_phase_up():
    timer = cudabench.PhaseTimer()
    assert timer.spent == dict.fromkeys(cudabench.PHASES, 0.0)
    for _ in range(2):
        with timer.phase("forward"):
            time.sleep(0.01)
    with timer.phase("chain"):  # a phase the engine adds later is kept too
        pass
    assert timer.spent["forward"] >= 0.02 and timer.spent["chain"] >= 0.0
    assert all(timer.spent[p] == 0.0 for p in cudabench.PHASES if p != "forward")


def test_cuda_requested_without_cuda_is_one_line_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit, match="CUDA is not available"):
        cudabench.main(["--tiny"])
