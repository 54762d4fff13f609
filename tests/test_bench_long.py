"""``hybridrt bench long`` (hybridrt/bench/long.py) at a tiny configuration: a row per weights x
KV dtype x length, its prefill and decode figures where asked, the attention's share in (0, 1),
and the CLI's refusals."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from hybridrt.bench import long
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.cli.main import app


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("long"), tiny_text_config(head_dim=32),
                                   seed=2, dtype=torch.bfloat16)


def test_rows_at_a_tiny_configuration(ckpt, tmp_path, capsys):
    out = tmp_path / "long.json"
    report = long.run(str(ckpt), weights=("bf16", "int8"), kv_dtypes=("bf16", "int8"),
                      lengths=(40, 70), depths=(0, 70), decode_tokens=2, threads=1,
                      json_path=str(out), progress=False, cache_memory=16 << 20)
    rows = report["rows"]
    assert [(r["weights"], r["kv"], r["length"]) for r in rows] == [
        (w, kv, n) for w in ("bf16", "int8") for kv in ("bf16", "int8") for n in (0, 40, 70)]
    for r in rows:
        assert r["prefill"] == (r["length"] in (40, 70)) and r["decode"] == (r["length"] in (0, 70))
        assert r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0
        assert 0 < r["prefill_attn_share"] < 1 and 0 < r["decode_attn_share"] < 1
    assert json.loads(out.read_text())["rows"] == rows
    text = capsys.readouterr().out
    assert "prefill tok/s" in text and "load average" in text
    assert "bf16 KV (" in text and "int8 KV (" in text and "tokens per request at 1" in text


def test_cli_refuses_bad_lists():
    """And --kv-cache-dtype, the shared flag, with one line before anything loads."""
    runner = CliRunner()
    res = runner.invoke(app, ["bench", "long", "--kv", "fp8"])
    assert res.exit_code == 2 and "--kv: unknown KV dtype 'fp8'" in res.output
    res = runner.invoke(app, ["bench", "long", "--lengths", "4k"])
    assert res.exit_code == 2 and "--lengths must be comma-separated integers" in res.output
    res = runner.invoke(app, ["generate", "-p", "x", "--kv-cache-dtype", "fp8"])
    assert res.exit_code == 2 and "--kv-cache-dtype: unknown dtype 'fp8'" in res.output
