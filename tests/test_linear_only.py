"""A model whose decoder has no full-attention layer (every layer Gated DeltaNet), dense and
MoE: the cache is sized without KV bytes (GDN state slots only; the KV blocks the scheduler
counts cost nothing) and the engine's greedy tokens equal transformers' (fp32), also with
k = 2 MTP speculation (the MTP layer's attention brings its own KV). transformers' own cache
refuses such a model (its mask sizes come from an attention layer), so its continuation is
computed over the whole sequence at each step, without a cache."""

from __future__ import annotations

import pytest
import torch

from hybridrt.bench.fixtures import (
    TINY_TEXT_CONFIG,
    hf_reference_model,
    random_state_dict,
    tiny_text_config,
    write_random_checkpoint,
)
from hybridrt.bench.moe_fixtures import hf_moe_reference, tiny_moe_config, write_moe_checkpoint
from hybridrt.config import ModelConfig
from hybridrt.llm import LLM
from hybridrt.sampling_params import SamplingParams
from hybridrt.statecache import CacheTensors, plan_cache
from hybridrt.statecache.capacity import context_capacity

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py

LIN = ["linear_attention"] * 3
CONFIGS = {"dense": tiny_text_config(TINY_TEXT_CONFIG, num_hidden_layers=3, layer_types=LIN),
           "moe": tiny_moe_config(num_hidden_layers=3, layer_types=LIN)}
MAX_TOKENS = 10


def _sd(name: str) -> dict[str, torch.Tensor]:
    return random_state_dict(ModelConfig.from_dict(CONFIGS[name]), seed=2)


def _reference(name: str):
    if name == "moe":
        return hf_moe_reference(CONFIGS[name], _sd(name))
    return hf_reference_model(CONFIGS[name], _sd(name), torch.float32)


def _hf_greedy(ref, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation, each token from a forward over the whole sequence."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = ref(torch.tensor([seq]), use_cache=False).logits[0, -1]
            seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def test_the_cache_holds_state_slots_only():
    """No KV bytes: the budget goes to state slots, the block count is what every sequence
    at full length needs (blocks of no bytes); context capacity is not bounded by KV."""
    config = ModelConfig.from_dict(CONFIGS["moe"])
    assert CacheTensors.bytes_per_block(config, 16, torch.float32) == 0
    per_slot = CacheTensors.bytes_per_slot(config, torch.float32)
    sizing = plan_cache(config, 100, 3, 16, torch.float32, memory_bytes=5 * per_slot)
    assert (sizing.num_slots, sizing.max_num_seqs, sizing.num_blocks) == (4, 3, 3 * 7)
    assert sizing.total_bytes == 4 * per_slot
    assert context_capacity(config, 5 * per_slot, torch.float32, 2,
                            dtype=torch.float32) == config.max_position_embeddings
    assert context_capacity(config, 2 * per_slot, torch.float32, 2, dtype=torch.float32) == 0
    # with the MTP layer's attention the blocks have bytes again and the budget bounds them
    assert CacheTensors.bytes_per_block(config, 16, torch.float32, 1) > 0


@pytest.mark.parametrize("name", ["dense", "moe"])
@pytest.mark.parametrize("k", [0, 2], ids=["k0", "k2"])
def test_greedy_equals_transformers(tmp_path, name, k):
    """Prompts of 1, 9 and 30 tokens decoded together (the 30-token one in chunks of a
    24-token step budget): greedy tokens equal transformers' greedy continuation."""
    write = write_moe_checkpoint if name == "moe" else write_random_checkpoint
    ckpt = write(tmp_path / name, CONFIGS[name], state_dict=_sd(name))
    V = CONFIGS[name]["vocab_size"]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (1, 9, 30)]
    ref = _reference(name)
    want = [_hf_greedy(ref, p, MAX_TOKENS) for p in prompts]
    llm = LLM(ckpt, dtype="float32", speculative_tokens=k, max_model_len=64, max_num_seqs=3,
              cache_memory=8 << 20, max_num_batched_tokens=24)
    assert llm.engine.cache.tensors.key_caches == [] or k
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    if k:
        assert outs[0].metrics["spec"]["num_rounds"] > 0
    assert llm.engine.cache.all_free()
