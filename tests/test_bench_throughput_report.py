"""``hybridrt bench throughput``'s printed report and progress: human row labels, one ratio per
row, no raw report key in the text, one read-bandwidth figure; what it will run and the progress
bar on stderr before the first measurement ends; the short default and ``--full``."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from hybridrt.bench import throughput as bench
from hybridrt.bench.fixtures import tiny_text_config, write_char_tokenizer, write_random_checkpoint
from hybridrt.bench.throughput_report import format_table
from hybridrt.cli.main import app

OURS = {"prefill_tok_s": 200.0, "decode_b1_tok_s": 10.0, "aggregate_b8_tok_s": 40.0,
        "decode_b8_tok_s": 50.0, "aggregate_b32_tok_s": 90.0, "decode_b32_tok_s": 120.0}


def _report(**more) -> dict:
    theirs = {k: v / 2 for k, v in OURS.items()}
    return {"threads": 2, "workload": {"prefill_len": 512}, "hybridrt": OURS,
            "transformers": theirs, "peak_rss_gib": 1.5,
            "ratio_aggregate_b32_vs_b1": 9.0, "ratio_decode_b32_vs_b1": 12.0,
            "interleaved_decode_b32_over_b1": 11.0,
            "ceilings": {"stream_read": {"gb_s": 20.0}, "weight_bytes_per_token": 2e9,
                         "batch1_decode_tok_s": 10.0, "fraction": {"hybridrt": 1.0},
                         "fraction_by_round": {"hybridrt": [0.5]},
                         "read_gb_s_by_round": [21.0]},
            **more}


def test_rows_have_human_labels_and_one_ratio_each():
    text = format_table(_report())
    rows = {ln[:38].strip(): ln[38:].split() for ln in text.splitlines()}
    for label in ("prefill, 512-token prompt", "decode, batch 1", "decode, 8 concurrent",
                  "decode, 32 concurrent", "output, 32 concurrent (prefill incl.)",
                  "peak RSS (GiB)"):
        assert label in rows, text
    assert rows["decode, 32 concurrent"] == ["120.00", "60.00", "2.00"]  # ours, theirs, ratio
    assert rows["peak RSS (GiB)"] == ["1.50", "-", "-"]
    assert not re.search(r"\w+_b?\d*_?tok_s|_vs_|_over_|gib\b", text)  # no raw report key
    # one batching ratio (the alternated runs'), one read-bandwidth figure
    assert [ln for ln in text.splitlines() if "/ batch 1" in ln] == [
        "batching: decode, 32 concurrent / batch 1 = 11.00x (alternated runs)"]
    assert text.count("GB/s") == 1 and "read bandwidth 20.0 GB/s" in text


def test_batching_ratio_from_the_rows_without_alternated_runs():
    report = _report()
    del report["interleaved_decode_b32_over_b1"]
    (line,) = [ln for ln in format_table(report).splitlines() if "/ batch 1" in ln]
    assert line == "batching: decode, 32 concurrent / batch 1 = 12.00x"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_text_config(), seed=5)
    write_char_tokenizer(d)
    return str(d)


def test_plan_and_bar_come_before_the_first_measurement_ends(tiny, monkeypatch, capsys):
    """By the time the first measurement (loading, then hybridrt's runs) is under way, stderr
    already holds what will run and the progress bar; at the end the bar has counted every
    step it announced."""
    seen = {}
    real = bench.bench_ours

    def first(*args, **kwargs):
        seen.setdefault("stderr", capsys.readouterr().err)
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "bench_ours", first)
    bench.throughput(tiny, dtype="float32", threads=1, prefill_len=8, prompt_len=4,
                     decode_tokens=2, concurrency=[2], repeats=1, transformers=True,
                     interleave=False, stream_bytes=1 << 20)
    err = seen["stderr"]
    assert err.startswith("bench throughput: hybridrt, transformers; prefill of a 8-token")
    assert re.search(r"\n\r?throughput: +\d+%\|.*loading hybridrt", err)  # the bar
    total = bench.our_runs(1, [2], False) + bench.transformers_runs(1, [2]) + 2
    assert f"{total}/{total}" in capsys.readouterr().err


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("full", [False, True])
def test_short_default_and_full(tiny, tmp_path, full):
    out = tmp_path / "r.json"
    res = _invoke("bench", "throughput", tiny, "--dtype", "float32", "--threads", "1",
                  "--prefill-len", "8", "--prompt-len", "4", "--decode-tokens", "2",
                  "--concurrency", "2", "--json", out, *(["--full"] if full else []))
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["workload"]["repeats"] == (2 if full else 1)
    assert ("transformers" in r) == full
    assert ("interleaved_decode_b2_over_b1" in r) == full


def test_a_figure_wider_than_its_column_never_runs_into_the_next():
    """A stand-in llama.cpp's tiny peak RSS gave a six-figure ratio that ran into the next
    column ('0.00687920.00'): every column keeps a space of its own."""
    from hybridrt.bench.throughput_report import _row

    line = _row("peak RSS (GiB)", 2.62, [("a", "x"), ("b", "y")], {"a": 3.8e-6, "b": 1.5e-3})
    assert line.split()[3:] == ["2.62", "0.00", "689473.68", "0.00", "1746.67"]
