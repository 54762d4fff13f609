"""``hybridrt bench responsive`` (hybridrt/bench/responsive.py) at a tiny configuration: while a
long prompt prefills in chunks of the step budget, the decoding request gets a token every
step, and the CLI refuses bad formats."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hybridrt.bench import responsive
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.cli.main import app


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("resp"), tiny_text_config(),
                                   seed=2, dtype=torch.bfloat16)


@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_decode_gets_a_token_every_step_of_a_long_prefill(ckpt, tmp_path, kv, capsys):
    out = tmp_path / "r.json"
    r = responsive.run(str(ckpt), prompt_len=300, budget=32, threads=1, kv=kv,
                       json_path=str(out), cache_memory=16 << 20)
    assert r["decode_tokens"] == r["steps"] == len(r["gaps_s"])
    assert r["steps"] == -(-300 // 31)  # chunks of the budget less the decode token
    assert r["largest_chunk"] == 31
    assert r["gap_max_s"] > 0 and r["gap_p99_s"] <= r["gap_max_s"]
    assert json.loads(out.read_text())["decode_tokens"] == r["decode_tokens"]
    assert "inter-token gap while it prefills" in capsys.readouterr().out


def test_cli_refuses_bad_formats():
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "responsive", "--kv", "fp8"])
    assert res.exit_code == 2 and "--kv: unknown KV dtype 'fp8'" in res.output
    res = runner.invoke(app, ["bench", "responsive", "--weights", "q4"])
    assert res.exit_code == 2 and "--weights: unknown format 'q4'" in res.output
