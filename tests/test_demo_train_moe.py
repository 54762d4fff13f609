"""scripts/demo/train.py --experts: a small MoE (the quality-per-byte proxy of docs/moe.md)
trains, and the checkpoint it writes is the one hybridrt and transformers both read: greedy
tokens equal to transformers' ``Qwen3_5MoeForCausalLM`` on it (fp32), the MTP layer an MoE
layer loaded too."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hybridrt import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py


def test_a_trained_moe_is_read_as_transformers_reads_it(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "demo"))
    try:
        import train
    finally:
        sys.path.remove(str(ROOT / "scripts" / "demo"))
    out = tmp_path / "moe"
    train.main(["--out", str(out), "--work", str(tmp_path / "work"), "--threads", "1",
                "--max-steps", "3", "--eval-minutes", "100", "--batch-size", "2",
                "--seq-len", "64", "--vocab-size", "512", "--hidden", "64", "--layers", "4",
                "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
                "--linear-key-heads", "2", "--linear-value-heads", "2",
                "--linear-head-dim", "32", "--experts", "4", "--experts-per-token", "2",
                "--expert-intermediate", "32", "--shared-intermediate", "48",
                "--save-dtype", "float32", "--corpus-repeats", "1"])
    tok, trunk, _ = train.load_checkpoint(out)
    assert type(trunk).__name__ == "Qwen3_5MoeForCausalLM"
    ids = tok.encode("def add(a, b):\n    return")
    want = trunk.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):]
    llm = LLM(str(out), dtype="float32", max_model_len=128, cache_memory="16MiB",
              speculative_tokens=2)
    assert llm.model.mtp is not None and llm.config.num_experts == 4
    (got,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)
    assert got.outputs[0].token_ids == want.tolist()
