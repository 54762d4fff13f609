"""``hybridrt bench attention`` (hybridrt/bench/prompt_attention.py) at small lengths: a row per
KV dtype x length for the prompt chunk (the tiled path within bf16 rounding of the whole-context
SDPA) and for decode, and the CLI's refusal."""

from __future__ import annotations

from typer.testing import CliRunner

from hybridrt.bench import prompt_attention
from hybridrt.cli.main import app
from hybridrt.kernels import native


def test_rows_at_small_lengths(capsys):
    r = prompt_attention.run(lengths=(40, 100), chunk=32, threads=1, repeats=1,
                             flush_bytes=1 << 20)
    prompt = [x for x in r["rows"] if x["kind"] == "prompt"]
    assert [(x["kv"], x["ctx"], x["chunk"]) for x in prompt] == [
        (kv, c, 32) for kv in ("bfloat16", "int8") for c in (40, 100)]
    assert all(x["ref_ms"] > 0 and x["tiled_ms"] > 0 and x["max_diff"] < 0.05 for x in prompt)
    decode = [x for x in r["rows"] if x["kind"] == "decode"]
    assert len(decode) == (4 if native.load() is not None else 0)
    assert all(x["ms"] > 0 and x["cold_ms"] > 0 for x in decode)
    assert "load average" in capsys.readouterr().out


def test_cli_refuses_a_bad_kv():
    res = CliRunner().invoke(app, ["bench", "attention", "--kv", "fp8"])
    assert res.exit_code == 2 and "--kv: unknown KV dtype 'fp8'" in res.output
