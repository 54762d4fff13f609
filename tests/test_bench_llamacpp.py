"""``hybridrt bench throughput --against-llamacpp``: llama.cpp's JSON lines parsed (real output of
llama-bench and llama-batched-bench in tests/data), the work it ran checked against ours, the
ratios, one-line errors, the side-by-side run with stand-in binaries; the ceilings (streaming
read loop, matmul, weight bytes per token). The real binaries are needed only by the last test,
skipped without them."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from hybridrt.bench import ceilings, llamacpp
from hybridrt.bench import throughput as bench
from hybridrt.bench.fixtures import tiny_text_config, write_char_tokenizer, write_random_checkpoint
from hybridrt.bench.throughput import steady_runs
from hybridrt.cli.main import app

DATA = Path(__file__).parent / "data"
# llama-bench -m r08b-bf16.gguf -t 2 -p 64 -n 4 -r 1 -o jsonl (the 0.8B shape, bf16)
LLAMA_BENCH = (DATA / "llama-bench.jsonl").read_text()
# llama-batched-bench -m r08b-bf16.gguf -t 2 -c 256 -npp 16 -ntg 4 -npl 2,4 --output-format jsonl
BATCHED_BENCH = (DATA / "llama-batched-bench.jsonl").read_text()


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def test_parse_llama_bench_real_output():
    r = llamacpp.parse_llama_bench(LLAMA_BENCH)
    pp, tg = (json.loads(line) for line in LLAMA_BENCH.splitlines())
    assert r == {"prefill_tok_s": pp["avg_ts"], "decode_b1_tok_s": tg["avg_ts"], "n_prompt": 64,
                 "n_gen": 4, "threads": 2, "model_bytes": 1505783040}
    assert r["prefill_tok_s"] > r["decode_b1_tok_s"] > 0
    pg = dict(tg, n_prompt=64, avg_ts=1.0)  # a -pg test (prompt then generation): not ours
    assert llamacpp.parse_llama_bench(LLAMA_BENCH + json.dumps(pg) + "\n") == r
    with pytest.raises(llamacpp.LlamaCppError, match="one prompt and one generation test"):
        llamacpp.parse_llama_bench(LLAMA_BENCH.splitlines()[0])


def test_parse_batched_bench_real_output_reads_s_tg():
    r = llamacpp.parse_batched_bench(BATCHED_BENCH)
    assert set(r) == {2, 4}
    for pl, row in r.items():
        line = next(json.loads(x) for x in BATCHED_BENCH.splitlines() if f'"pl": {pl},' in x)
        # S_TG is pl x tg new tokens over the decode time
        assert row["decode_tok_s"] == line["speed_tg"] == pytest.approx(pl * 4 / line["t_tg"],
                                                                        rel=1e-4)
        assert (row["prompt_len"], row["new_tokens"], row["threads"]) == (16, 4, 2)
    with pytest.raises(llamacpp.LlamaCppError, match="no JSON lines"):
        llamacpp.parse_batched_bench("\nmain: error\n")


def test_ratios_and_context_size():
    ours = {"prefill_tok_s": 30.0, "decode_b1_tok_s": 5.0, "aggregate_b8_tok_s": 9.0,
            "decode_b8_tok_s": 12.0}
    theirs = {"prefill_tok_s": 60.0, "decode_b1_tok_s": 4.0, "decode_b8_tok_s": 24.0}
    assert llamacpp.ratios(ours, theirs) == {"prefill_tok_s": 0.5, "decode_b1_tok_s": 1.25,
                                             "decode_b8_tok_s": 0.5}
    assert llamacpp.context_size(16, 16, [8, 32]) == 1024  # 32 x 32 tokens
    assert llamacpp.context_size(16, 17, [8, 32]) == 1280  # 32 x 33, rounded up to 256


def test_unequal_work_is_refused():
    ours = {"prefill_tok_s": {"requests": 1, "prompt_len": 64, "new_tokens": 1},
            "decode_b1_tok_s": {"requests": 1, "prompt_len": 16, "new_tokens": 4},
            "decode_b2_tok_s": {"requests": 2, "prompt_len": 16, "new_tokens": 4}}
    theirs = {"prefill_tok_s": {"requests": 1, "prompt_len": 64, "new_tokens": 0},
              "decode_b1_tok_s": {"requests": 1, "prompt_len": 0, "new_tokens": 4},
              "decode_b2_tok_s": {"requests": 2, "prompt_len": 16, "new_tokens": 4}}
    bench._check_same_work(ours, theirs)  # llama-bench: no token after pp, no prompt before tg
    for row, key in (("prefill_tok_s", "prompt_len"), ("decode_b1_tok_s", "new_tokens"),
                     ("decode_b2_tok_s", "prompt_len"), ("decode_b2_tok_s", "requests")):
        bad = json.loads(json.dumps(theirs))
        bad[row][key] += 1
        with pytest.raises(RuntimeError, match=f"unequal work in {row}"):
            bench._check_same_work(ours, bad)


def test_missing_gguf_binaries_or_bad_order_are_one_line_errors(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    res = invoke("bench", "throughput", "--against-llamacpp", gguf)
    assert res.exit_code == 2 and f"no GGUF file at {gguf}" in one_error_line(res.stderr)
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("LLAMACPP_HOME", str(tmp_path / "home"))
    res = invoke("bench", "throughput", "--against-llamacpp", gguf)
    line = one_error_line(res.stderr)
    assert res.exit_code == 2 and "llama-bench, llama-batched-bench" in line
    assert str(tmp_path / "home" / "llama.cpp" / "build" / "bin") in line
    (tmp_path / "llama-bench").write_text("#!/bin/sh\n")
    (tmp_path / "llama-bench").chmod(0o755)
    res = invoke("bench", "throughput", "--against-llamacpp", gguf, "--llamacpp-bin", tmp_path)
    line = one_error_line(res.stderr)
    assert "not found: llama-batched-bench in" in line and "llama-bench," not in line
    res = invoke("bench", "throughput", "--order", "hybridrt,hybridrt")
    assert res.exit_code == 2 and "--order needs hybridrt and llamacpp" in one_error_line(
        res.stderr)


def test_child_peak_rss_is_the_childs_own():
    """A child allocating 400 MiB: its VmHWM, not this (larger, torch-holding) process's."""
    big = torch.ones(1 << 28)  # 1 GiB here: a fork's rusage would report at least this
    code = "import time; x = bytearray({} << 20); time.sleep(0.3); print('done')"
    _, base = llamacpp.run_child([sys.executable, "-c", code.format(0)])
    out, peak = llamacpp.run_child([sys.executable, "-c", code.format(400)])
    assert out.strip() == "done" and abs(peak - base - (400 << 20)) < 4 << 20
    del big
    with pytest.raises(llamacpp.LlamaCppError, match=r"python.* exited with 3: boom"):
        llamacpp.run_child([sys.executable, "-c",
                            "import sys; print('boom', file=sys.stderr); sys.exit(3)"])


FAKE = '''#!{python}
"""Stands in for {name}: prints the real sample's JSON lines for the work asked, and its args."""
import json, sys
args = sys.argv[1:]
opt = {{args[i]: args[i + 1] for i in range(0, len(args) - 1, 2)}}
open(__file__ + ".args", "a").write(" ".join(args) + "\\n")
call = len(open(__file__ + ".args").readlines())  # 1, 2, ...: each round's figures differ
lines = [json.loads(x) for x in open({sample!r}) if x.startswith("{{")]
if "{name}" == "llama-bench":
    pp, tg = lines
    pp.update(n_prompt=int(opt["-p"]) + {skew}, n_threads=int(opt["-t"]), avg_ts=100.0 * call)
    tg.update(n_gen=int(opt["-n"]), n_threads=int(opt["-t"]), avg_ts=4.0 * call)
    lines = [pp, tg]
else:
    lines = [dict(lines[0], pl=int(pl), pp=int(opt["-npp"]), tg=int(opt["-ntg"]),
                  n_threads=int(opt["-t"]), speed_tg=10.0 * int(pl) * call)
             for pl in opt["-npl"].split(",")]
for line in lines:
    print(json.dumps(line))
'''


def fake_llamacpp(directory: Path, skew: int = 0) -> Path:
    """llama-bench and llama-batched-bench stand-ins (pp = 100, tg = 4, S_TG = 10 x pl tok/s,
    times the number of the call);
    ``skew`` tokens added to the prompt llama-bench reports."""
    directory.mkdir()
    for name, sample in (("llama-bench", DATA / "llama-bench.jsonl"),
                         ("llama-batched-bench", DATA / "llama-batched-bench.jsonl")):
        path = directory / name
        path.write_text(FAKE.format(python=sys.executable, name=name, sample=str(sample),
                                    skew=skew))
        path.chmod(0o755)
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tiny"), tiny_text_config(), seed=5)
    write_char_tokenizer(d)
    return str(d)


def test_side_by_side_report_with_stand_in_binaries(tiny, tmp_path):
    bins = fake_llamacpp(tmp_path / "bin")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "r.json"
    res = invoke("bench", "throughput", tiny, "--dtype", "float32", "--threads", "1",
                 "--prefill-len", "16", "--prompt-len", "4", "--decode-tokens", "3",
                 "--concurrency", "2,3", "--repeats", "1", "--no-transformers",
                 "--against-llamacpp", gguf, "--llamacpp-bin", bins,
                 "--order", "llamacpp,hybridrt,llamacpp", "--json", out)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    # two llama.cpp rounds, the second's figures twice the first's: their medians
    assert [x["results"]["decode_b2_tok_s"] for x in r["rounds"] if x["engine"] == "llamacpp"
            ] == [20.0, 40.0]
    assert r["llamacpp"] == {"prefill_tok_s": 150.0, "decode_b1_tok_s": 6.0,
                             "decode_b2_tok_s": 30.0, "decode_b3_tok_s": 45.0}
    assert r["ratio_vs_llamacpp"] == {k: pytest.approx(r["hybridrt"][k] / v)
                                      for k, v in r["llamacpp"].items()}
    assert [x["engine"] for x in r["rounds"]] == ["llamacpp", "hybridrt", "llamacpp"]
    assert all(len(x["load_average"]) == 3 for x in r["rounds"])
    assert r["work"]["llamacpp"]["decode_b3_tok_s"] == r["work"]["hybridrt"]["decode_b3_tok_s"]
    # what llama.cpp was asked: the same lengths, threads and sequences as ours
    args = (bins / "llama-bench.args").read_text().splitlines()
    assert len(args) == 2 and all("-t 1 -p 16 -n 3 -r 1 -o jsonl" in a for a in args)
    (batched,) = set((bins / "llama-batched-bench.args").read_text().splitlines())
    assert "-t 1 -c 256 -npp 4 -ntg 3 -npl 2,3 --output-format jsonl" in batched
    assert 0 < r["llamacpp_run"]["peak_rss_gib"] < r["peak_rss_gib"]
    assert r["cpu"]["model"] == ceilings.cpu_info()["model"]
    c = r["ceilings"]
    assert c["batch1_decode_tok_s"] == pytest.approx(
        c["stream_read"]["gb_s"] * 1e9 / c["weight_bytes_per_token"])
    assert c["fraction"]["llamacpp"] == pytest.approx(6.0 / c["batch1_decode_tok_s"])
    assert c["fraction"]["hybridrt"] == pytest.approx(
        r["hybridrt"]["decode_b1_tok_s"] / c["batch1_decode_tok_s"])
    # each round against the read loop run just before it
    reads = c["read_gb_s_by_round"]
    assert len(reads) == 3 and all(g > 0 for g in reads)
    label = next(x["gguf"] for x in r["rounds"] if x["engine"] == "llamacpp")
    assert c["fraction_by_round"]["llama.cpp " + label] == [
        pytest.approx(x["results"]["decode_b1_tok_s"] * c["weight_bytes_per_token"] / (g * 1e9))
        for x, g in zip(r["rounds"], reads, strict=True) if x["engine"] == "llamacpp"]
    assert c["fraction_by_round"]["hybridrt"] == [pytest.approx(
        r["rounds"][1]["results"]["decode_b1_tok_s"] * c["weight_bytes_per_token"]
        / (reads[1] * 1e9))]
    assert c["state_bytes_per_token"] > 0
    # each of our batch-1 runs against the read loop run just before it
    ours = r["rounds"][1]
    assert len(ours["b1_pairs"]) == 5 and ours["results"]["decode_b1_tok_s"] == (
        statistics.median(rate for rate, _, _ in ours["b1_pairs"]))
    assert c["fraction_by_run"] == [pytest.approx(rate * c["weight_bytes_per_token"] / (g * 1e9))
                                    for rate, g, _ in ours["b1_pairs"]]
    # a run's read after it is the next run's read before it; the last one its own
    pairs = ours["b1_pairs"]
    assert [a for _, _, a in pairs[:-1]] == [g for _, g, _ in pairs[1:]] and pairs[-1][2] > 0
    assert c["steady_runs"] == steady_runs([tuple(p) for p in pairs], c["weight_bytes_per_token"])
    for text in ("llama.cpp", "own random prompt tokens", "peak RSS (GiB)",
                 "batch-1 ceiling", "read bandwidth"):
        assert text in res.stdout
    # one read-bandwidth figure in the text, the one the batch-1 ceiling is taken against
    assert res.stdout.count("GB/s") == 1
    assert f"read bandwidth {c['stream_read']['gb_s']:.1f} GB/s" in res.stdout


def test_steady_runs_keep_the_runs_whose_reads_agree_against_their_mean():
    """A batch-1 run counts as steady when the read loops before and after it differ by at most
    10% of the first (the machine did not change read level under it); its fraction is taken
    against the two reads' mean; the steady runs come sorted by that read."""
    per_token = 500_000_000
    pairs = [(50.0, 30.0, 31.0),   # steady
             (45.0, 30.0, 55.0),   # the read moved: left out
             (60.0, 55.0, 56.0),   # steady, at a higher read
             (52.0, 30.0, 33.0),   # exactly 10%: steady
             (52.0, 30.0, 33.5),   # just over: left out
             (40.0, 40.0, 36.0)]   # down by exactly 10%: steady
    got = steady_runs(pairs, per_token)
    kept = [(50.0, 30.5), (52.0, 31.5), (40.0, 38.0), (60.0, 55.5)]
    assert [(r["tok_s"], r["read_gb_s"]) for r in got] == kept
    assert [r["fraction"] for r in got] == [pytest.approx(rate * per_token / (read * 1e9))
                                            for rate, read in kept]
    assert steady_runs(pairs, per_token, tolerance=0.0) == []
    assert steady_runs([], per_token) == []


def test_read_loop_apart_leaves_this_processs_peak_rss_alone():
    """The read loop a benchmark runs before each round: in a child process, its buffer (here
    larger than this process's peak so far) never in this process's peak RSS."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    size = (before + (256 << 20)) // 4 * 4
    assert ceilings.stream_read_apart(1, size, passes=1) > 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < before + (64 << 20)


def test_state_bytes_per_token_is_one_sequences_gdn_state_read_and_written():
    """Every GDN layer's conv state ((kernel - 1) x conv dim, the model's dtype) and ssm state
    (value heads x key dim x value dim, fp32) of one sequence, twice."""
    from hybridrt.config import ModelConfig
    from hybridrt.statecache.tensors import CacheTensors

    cfg = ModelConfig.from_dict(tiny_text_config())
    t = CacheTensors.allocate(cfg, num_blocks=2, block_size=16, num_slots=3,
                              dtype=torch.bfloat16)
    conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + (
        cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    one = len(cfg.linear_attention_layers) * (
        (cfg.linear_conv_kernel_dim - 1) * conv_dim * 2
        + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    assert ceilings.state_bytes_per_token(t) == 2 * one


def test_several_ggufs_each_in_every_llamacpp_round(tiny, tmp_path):
    """--against-llamacpp twice (e.g. Q4_K_M and Q4_0): each GGUF runs in every llama.cpp round,
    in turn; the first is the report's ``llamacpp``, the second ``llamacpp_others`` by file name,
    each with its medians, ratios and peak RSS, and a column of its own in the table."""
    bins = fake_llamacpp(tmp_path / "bin")
    a, b = tmp_path / "m-Q4_K_M.gguf", tmp_path / "m-Q4_0.gguf"
    for g in (a, b):
        g.write_bytes(b"GGUF")
    out = tmp_path / "r.json"
    res = invoke("bench", "throughput", tiny, "--dtype", "float32", "--threads", "1",
                 "--prefill-len", "16", "--prompt-len", "4", "--decode-tokens", "3",
                 "--concurrency", "2", "--repeats", "1", "--no-transformers",
                 "--against-llamacpp", a, "--against-llamacpp", b, "--llamacpp-bin", bins,
                 "--order", "llamacpp,hybridrt,llamacpp", "--json", out)
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert [(x["engine"], x.get("gguf")) for x in r["rounds"]] == [
        ("llamacpp", "m-Q4_K_M"), ("llamacpp", "m-Q4_0"), ("hybridrt", None),
        ("llamacpp", "m-Q4_K_M"), ("llamacpp", "m-Q4_0")]
    # the stand-ins' figures grow with each call: Q4_K_M ran calls 1 and 3, Q4_0 calls 2 and 4
    assert r["llamacpp"]["decode_b1_tok_s"] == 8.0  # 4 x median(1, 3)
    other = r["llamacpp_others"]["m-Q4_0"]
    assert other["results"]["decode_b1_tok_s"] == 12.0  # 4 x median(2, 4)
    assert other["ratio"]["decode_b1_tok_s"] == pytest.approx(
        r["hybridrt"]["decode_b1_tok_s"] / 12.0)
    assert other["run"]["gguf"] == str(b) and other["run"]["peak_rss_gib"] > 0
    assert r["ceilings"]["fraction"]["llamacpp m-Q4_0"] == pytest.approx(
        12.0 / r["ceilings"]["batch1_decode_tok_s"])
    header = next(ln for ln in res.stdout.splitlines() if ln.startswith("metric"))
    assert header.split() == ["metric", "hybridrt", "m-Q4_K_M", "ratio", "m-Q4_0", "ratio"]
    rss = next(ln for ln in res.stdout.splitlines() if ln.startswith("peak RSS"))
    assert len(rss.split()) == 3 + 1 + 2 * 2  # label, hybridrt, each GGUF's figure and ratio


def test_plot_has_a_bar_per_engine_and_row(tmp_path, monkeypatch):
    figure = pytest.importorskip("matplotlib.figure")

    from hybridrt.cli.bench import plot_throughput

    drawn = []
    monkeypatch.setattr(figure.Figure, "savefig", lambda fig, *a, **k: drawn.append(
        {c.get_label(): [b.get_height() for b in c] for c in fig.axes[0].containers}))
    rows = {"prefill_tok_s": 100.0, "decode_b1_tok_s": 10.0}
    plot_throughput({"model": "m", "dtype": "bf16", "threads": 2, "hybridrt": rows,
                     "llamacpp": {"prefill_tok_s": 70.0, "decode_b1_tok_s": 7.0},
                     "transformers": {"prefill_tok_s": 50.0}}, tmp_path / "t.png")
    assert drawn == [{"hybridrt": [100.0, 10.0], "llama.cpp": [70.0, 7.0],
                      "transformers": [50.0, 0.0]}]


def test_llamacpp_running_other_work_is_refused(tiny, tmp_path):
    bins = fake_llamacpp(tmp_path / "bin", skew=1)  # reports a 17-token prompt for 16 asked
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(llamacpp.LlamaCppError, match=r"llama-bench ran .* \(17, 3, 1\), not "
                                                     r"\(16, 3, 1\)"):
        llamacpp.bench(gguf, bins, threads=1, prefill_len=16, prompt_len=4, decode_tokens=3,
                       concurrency=[2])


# ceilings -------------------------------------------------------------------------------------
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [1, 17, 64, 1000, 1 << 17, (1 << 17) + 63])
def test_stream_sum_reads_every_element(n, threads):
    from hybridrt.kernels import native

    if native.load() is None:
        pytest.skip("native CPU kernels unavailable")
    g = torch.Generator().manual_seed(n)
    x = torch.randint(0, 8, (n,), generator=g).float()  # integer sums: exact in any order
    assert ceilings.stream_sum(x, threads) == float(x.double().sum())
    assert ceilings.stream_sum(x[1:], threads) == float(x[1:].double().sum())  # unaligned start


def test_stream_sum_rejects_other_tensors():
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        ceilings.stream_sum(torch.ones(4, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="contiguous CPU float32"):
        ceilings.stream_sum(torch.ones(4, 2).t(), 1)


def test_stream_read_and_matmul_rates_are_positive():
    s = ceilings.stream_read(2, size_bytes=16 << 20, passes=2)
    assert s["gb_s"] > 0 and s["bytes"] == 16 << 20 and s["threads"] == 2
    assert s["vector_bits"] in (512, 256, 32, None)
    for huge in (True, False):  # every element read (a partial read raises), either memory
        assert ceilings.stream_read(1, size_bytes=6 << 20, passes=1,
                                    huge_pages=huge)["huge_pages"] is huge
    m = ceilings.matmul_rate(1, 64, 64, 64, reps=2)
    assert m["gflop_s"] > 0 and m["shape"] == [64, 64, 64]


def test_cpu_info_reads_model_and_the_listed_flags():
    text = ("processor\t: 0\nmodel name\t: Some CPU @ 2.00GHz\nflags\t\t: fpu avx2 fma "
            "avx512f avx512_bf16 amx_tile sse\nprocessor\t: 1\nmodel name\t: Other\n")
    assert ceilings.cpu_info(text) == {"model": "Some CPU @ 2.00GHz",
                                       "flags": ["avx2", "fma", "avx512f", "avx512_bf16",
                                                 "amx_tile"]}
    assert ceilings.cpu_info("") == {"model": None, "flags": []}


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_per_token_counts_layers_and_lm_head_once(tied):
    from helpers import build_model

    net, config, _ = build_model(tiny_text_config(tie_word_embeddings=tied), with_mtp=True,
                                 dtype=torch.bfloat16)
    assert net.mtp is not None and (net.lm_head is None) == tied
    layers = sum(p.numel() for p in net.model.layers.parameters())
    expected = 2 * (layers + config.hidden_size + config.vocab_size * config.hidden_size)
    assert ceilings.weight_bytes_per_token(net) == expected


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_per_token_of_an_int8_model(tied, tmp_path):
    """int8 weights count as their int8 values and scales: all of the model's weight bytes
    (``quant.weight_bytes``; no MTP loaded) but an untied embedding, and fewer than bf16's."""
    from hybridrt.bench.fixtures import write_random_checkpoint
    from hybridrt.kernels import quant
    from hybridrt.llm import LLM

    d = write_random_checkpoint(tmp_path / "m", tiny_text_config(tie_word_embeddings=tied),
                                seed=1, dtype=torch.bfloat16)
    bf16 = ceilings.weight_bytes_per_token(LLM(d, tokenizer=None).model)
    m = LLM(d, tokenizer=None, quantization="int8").model
    assert m.mtp is None
    untied = 0 if tied else m.model.embed_tokens.qweight.nbytes
    assert ceilings.weight_bytes_per_token(m) == quant.weight_bytes(m) - untied < 0.8 * bf16


LLAMACPP_BIN = llamacpp.bin_dir()
GGUF = os.environ.get("HYBRIDRT_TEST_GGUF", "/tmp/r08b-bf16.gguf")


@pytest.mark.skipif(not (LLAMACPP_BIN / "llama-bench").exists() or not Path(GGUF).is_file(),
                    reason="needs llama.cpp's binaries and a GGUF (HYBRIDRT_TEST_GGUF)")
def test_real_llamacpp_runs_the_work_asked():
    res, work, run = llamacpp.bench(GGUF, llamacpp.check(GGUF), threads=1, prefill_len=8,
                                    prompt_len=4, decode_tokens=2, concurrency=[2])
    assert set(res) == {"prefill_tok_s", "decode_b1_tok_s", "decode_b2_tok_s"}
    assert all(v > 0 for v in res.values()) and run["peak_rss_gib"] > 0
    assert work["decode_b2_tok_s"] == {"requests": 2, "prompt_len": 4, "new_tokens": 2}


def test_stream_read_takes_the_weights_kind_of_pages(monkeypatch):
    """The read loop's buffer on the pages the loaded weights get: huge pages where the options
    and the OS give the weights them (a 4 KiB-page buffer reads slower and would understate
    the weights' ceiling), else 4 KiB pages."""
    from hybridrt.kernels import memory

    monkeypatch.setattr(memory, "huge_pages_available", lambda: True)
    monkeypatch.delenv("HYBRIDRT_HUGE_PAGES", raising=False)
    made = []
    arena = memory.HugeArena
    monkeypatch.setattr(memory, "HugeArena", lambda n: made.append(n) or arena(n))
    assert ceilings.stream_read(1, size_bytes=4 << 20, passes=1)["huge_pages"] is True
    assert made == [4 << 20]
    monkeypatch.setenv("HYBRIDRT_HUGE_PAGES", "0")
    assert ceilings.stream_read(1, size_bytes=4 << 20, passes=1)["huge_pages"] is False
    monkeypatch.setattr(memory, "huge_pages_available", lambda: False)
    monkeypatch.delenv("HYBRIDRT_HUGE_PAGES")
    assert ceilings.stream_read(1, size_bytes=4 << 20, passes=1)["huge_pages"] is False
    assert made == [4 << 20]


# hybridrt bench llamacpp-build ---------------------------------------------------------------
def test_build_plan_commands_and_paths(tmp_path, monkeypatch):
    """The pinned sdist downloaded with pip, unpacked into $LLAMACPP_HOME/llama.cpp, built with
    cmake for this CPU, static, without tests or server; the binaries where --llamacpp-bin's
    default looks."""
    from hybridrt.bench import llamacpp_build as lb

    monkeypatch.setenv("LLAMACPP_HOME", str(tmp_path))
    p = lb.plan(python="py", jobs=3)
    assert p.download == ["py", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                          "--dest", str(tmp_path / "sdist"), "llama-cpp-python==0.3.36"]
    assert p.sdist == tmp_path / "sdist" / "llama_cpp_python-0.3.36.tar.gz"
    assert p.member == "llama_cpp_python-0.3.36/vendor/llama.cpp"
    src, build = tmp_path / "llama.cpp", tmp_path / "llama.cpp" / "build"
    assert p.configure[:5] == ["cmake", "-S", str(src), "-B", str(build)]
    for flag in ("-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_SERVER=OFF", "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
                 "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"):
        assert flag in p.configure
    assert p.compile == ["cmake", "--build", str(build), "--config", "Release", "-j", "3",
                         "--target", "llama-bench", "llama-batched-bench", "llama-quantize",
                         "llama-perplexity"]
    assert p.bin == llamacpp.bin_dir() == build / "bin"


def test_build_unpacks_llama_cpp_and_skips_what_is_there(tmp_path, monkeypatch):
    """Only the sdist's vendor/llama.cpp lands in the source folder; a present sdist is not
    downloaded again; present binaries mean nothing runs at all."""
    import io
    import tarfile

    from hybridrt.bench import llamacpp_build as lb

    p = lb.plan(tmp_path)
    p.sdist_dir.mkdir()
    with tarfile.open(p.sdist, "w:gz") as tar:
        for name in (f"{p.member}/CMakeLists.txt", f"{p.member}/tools/x.cpp", "other/setup.py"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"ok"))
    ran = []

    def fake_run(step, cmd):
        ran.append(cmd)
        if cmd is p.configure:  # what cmake records of the settings
            p.build.mkdir(parents=True, exist_ok=True)
            (p.build / "CMakeCache.txt").write_text("".join(
                f"{a[2:].split('=')[0]}:STRING={a.split('=', 1)[1]}\n" for a in cmd
                if a.startswith("-D")))
        if cmd is p.compile:
            p.bin.mkdir(parents=True, exist_ok=True)
            for t in lb.TARGETS:
                (p.bin / t).write_text("")
                (p.bin / t).chmod(0o755)

    monkeypatch.setattr(lb, "_run", fake_run)
    monkeypatch.setattr(lb, "check_tools", lambda: None)
    assert lb.build(p) == p.bin
    assert ran == [p.configure, p.compile]  # the sdist was there: no download
    assert sorted(f.relative_to(p.source).as_posix() for f in p.source.rglob("*.*")
                  if "build" not in f.parts) == ["CMakeLists.txt", "tools/x.cpp"]
    ran.clear()
    assert lb.build(p) == p.bin and ran == []
    cache = p.build / "CMakeCache.txt"  # a build made before NO_AMX: configured and built again
    cache.write_text(cache.read_text().replace(lb.NO_AMX, ""))
    assert not lb.built(p)
    assert lb.build(p) == p.bin and ran == [p.configure, p.compile] and lb.built(p)


def test_build_without_cmake_says_what_to_install(tmp_path, monkeypatch):
    from hybridrt.bench import llamacpp_build as lb

    monkeypatch.setattr(lb.shutil, "which", lambda name: None)
    res = invoke("bench", "llamacpp-build", "--home", tmp_path)
    assert res.exit_code == 1
    assert one_error_line(res.stderr) == (
        "error: cmake not found: apt-get install cmake build-essential")
