"""Preemption under memory pressure makes progress (issue 29): the scheduler's admission
control (``Scheduler._room_for``) against the old rule, admit whatever this step's chunk fits
(``admission_control = False``), on one long request beside several short ones; greedy outputs
equal to one-at-a-time runs in fp32. The rules are run by ``hybridrt.bench.preemption``, which
is also ``hybridrt bench preemption``: the issue's own workload (minutes on CPU) has its figures
in docs/server.md."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.bench.preemption import run_rule, workload
from hybridrt.cli.main import app
from hybridrt.llm import LLM


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_text_config(), seed=5)


def _budget(ckpt, num_blocks: int, num_slots: int) -> int:
    from hybridrt.statecache import CacheTensors

    probe = LLM(ckpt, dtype="float32", max_model_len=192)
    cfg, dtype = probe.config, probe.dtype
    extra = probe.model.num_attention_caches - len(cfg.full_attention_layers)
    return (num_blocks * CacheTensors.bytes_per_block(cfg, 16, dtype, extra)
            + num_slots * CacheTensors.bytes_per_slot(cfg, dtype, 16, extra))


def test_memory_pressure_makes_progress_and_keeps_greedy_outputs(ckpt):
    """One 120 + 40 and six 40 + 16 tokens in a cache of 24 blocks (384 tokens; the whole
    batch needs 616): fewer preemptions and fewer recomputed tokens than the chunk rule, and
    every output equal to the request run alone."""
    prompts, params = workload(97, (120, 40), (40, 16), 6)
    llm = LLM(ckpt, dtype="float32", max_model_len=192, max_num_seqs=8,
              max_num_batched_tokens=32, cache_memory=_budget(ckpt, 24, 9),
              checkpoint_share=0.0)  # the budget is for the blocks and request slots only
    assert llm.cache_sizing.num_blocks == 24
    alone = [run_rule(llm, [p], [sp], "admission")["outputs"][0]
             for p, sp in zip(prompts, params)]
    new = run_rule(llm, prompts, params, "admission")
    old = run_rule(llm, prompts, params, "chunk")
    print(f"\npreemptions {new['preemptions']} (chunk rule {old['preemptions']}), recomputed "
          f"prompt tokens {new['prefilled_again']} (chunk rule {old['prefilled_again']})")
    assert new["outputs"] == alone and old["outputs"] == alone
    assert old["preemptions"] > 0 and new["preemptions"] < old["preemptions"] / 2, (
        new["preemptions"], old["preemptions"])
    assert new["prefilled_again"] < old["prefilled_again"]
    assert llm.engine.scheduler.admission_control  # each run puts the rule back


def test_bench_preemption_command_on_a_tiny_checkpoint(ckpt, tmp_path):
    """``hybridrt bench preemption`` with the workload scaled down: both rules in one run,
    the table printed, the JSON report with preemptions per rule, and the outputs of both
    rules equal to each request run alone (float32)."""
    out = tmp_path / "preemption.json"
    res = CliRunner().invoke(app, [
        "bench", "preemption", str(ckpt), "--dtype", "float32", "--cache-memory",
        str(_budget(ckpt, 24, 9)), "--max-model-len", "192", "--max-num-batched-tokens", "32",
        "--long", "120,40", "--short", "40,16", "--num-short", "6", "--rounds", "2",
        "--check-alone", "--threads", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "| rule | preemptions | prefilled_again | steps | wall_s |" in res.output
    report = json.loads(out.read_text())
    chunk, admission = report["rows"]
    assert (chunk["rule"], admission["rule"]) == ("chunk", "admission")
    assert len(chunk["preemptions"]) == len(admission["preemptions"]) == 2
    assert min(chunk["preemptions"]) > 0
    assert max(admission["preemptions"]) < min(chunk["preemptions"]) / 2
    assert max(admission["prefilled_again"]) < min(chunk["prefilled_again"])
    assert chunk["wall_s"] > 0 and admission["generated_tok_s"] > 0
    assert report["outputs_equal"] is True
    assert report["alone_equal"] == {"chunk": True, "admission": True}
    assert "24 blocks" in report["cache"]


@pytest.mark.parametrize("args, words", [
    (["--long", "5"], "--long takes PROMPT,GENERATED"),
    (["--short", "1000,x"], "--short must be comma-separated integers"),
    (["--max-model-len", "1000"], "does not fit --max-model-len 1000"),
    (["--cache-memory", "lots"], "--cache-memory"),
])
def test_bench_preemption_refuses_bad_options(args, words):
    res = CliRunner().invoke(app, ["bench", "preemption", *args])
    assert res.exit_code == 2 and words in res.output, res.output
