"""``hybridrt bench kv-quality`` (hybridrt/bench/kv_quality.py): int8 against bf16 KV on the demo
model over a window of the held-out text; bf16 against itself is exact; chunking a window does
change its scores only by bf16 rounding."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from hybridrt.bench import kv_quality
from hybridrt.bench.quality import _load
from hybridrt.cli.main import app
from hybridrt.llm import default_model


@pytest.fixture(scope="module")
def demo():
    from transformers import PreTrainedTokenizerFast

    from hybridrt.bench.quality import held_out_text

    path = default_model()
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    return _load(path, None), tok.encode(held_out_text(tok))[:512]


def test_int8_kv_close_to_bf16_kv(demo):
    model, ids = demo
    r = kv_quality.compare(model, ids, n_ctx=256, chunk=100)
    assert r["windows"] == 2 and r["tokens_scored"] == 2 * 127
    assert 0 < r["kl_mean_int8"] < 1e-3 and r["kl_max_int8"] < 0.05
    assert abs(r["ppl_change_int8"]) < 0.01 and r["greedy_agreement_int8"] > 0.95


def test_bf16_against_itself_and_chunking(demo):
    model, ids = demo
    r = kv_quality.compare(model, ids[:256], n_ctx=256, chunk=256, kv_dtypes=("bf16", "bf16"))
    assert r["kl_max_bf16"] == 0 and r["greedy_agreement_bf16"] == 1
    one = kv_quality.window_logprobs(model, ids[:256], torch.bfloat16, chunk=256)
    chunked = kv_quality.window_logprobs(model, ids[:256], torch.bfloat16, chunk=37)
    assert (one - chunked).abs().mean() < 0.01  # bf16 activations: chunked ~ one-shot
    assert torch.equal(one.argmax(-1), chunked.argmax(-1))


def test_too_short_a_text_is_refused():
    res = CliRunner().invoke(app, ["bench", "kv-quality", "--ctx", "100000"])
    assert res.exit_code == 2 and "fewer than one window of 100000" in res.output
