"""Long prompts end to end at a tiny shape: an 8192-token prompt against transformers (fp32),
and a 65536-token prompt whose greedy tokens with an int8 or bf16 KV cache equal the fp32
cache's (the length pattern of the 0.8B-shape 64k run in docs/long_context.md)."""

from __future__ import annotations

import pytest
import torch
from helpers import PackedRunner, assert_rel_close, build_pair, hf_prefill_decode

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.kernels import native, prefill_attention
from hybridrt.kernels.backend.cpu import CPUBackend

pytestmark = pytest.mark.skipif(
    native.load() is None or not prefill_attention.available(),
    reason="needs the compiled kernels and torch's CPU flash-attention kernel")


def test_8k_prompt_in_chunks_and_decode_match_transformers():
    """8192 tokens in four chunks of 2048 (prompt attention in tiles of 4096 positions, the
    second tile reached by the third chunk), then 4 greedy decode steps (the decode kernel's
    16 partitions of 512): the decode logits within 1e-4 of transformers' and the same tokens;
    the prompt's within 5e-4 (measured 2.3e-4 at its worst position, no growth along the 8k
    positions, and the chunked prefill bit-equal to a one-shot one: transformers' chunked delta
    rule in fp32 rounds so; the state it leaves decodes within 5e-7)."""
    net, ref, config = build_pair(tiny_text_config(max_position_embeddings=16384), seed=0)
    net.set_backend(CPUBackend(config))
    prompt = torch.randint(0, config.vocab_size, (8192,),
                           generator=torch.Generator().manual_seed(5))
    ref_prefill, fed, ref_decode = hf_prefill_decode(ref, prompt, 4)
    runner = PackedRunner(net, 1, len(prompt) + 4, block_size=16)
    out = [runner.step([(0, prompt[a:a + 2048])])[0] for a in range(0, 8192, 2048)]
    assert_rel_close(torch.cat(out), ref_prefill, 5e-4, "8192-token prefill in chunks")
    decode = torch.cat([runner.step([(0, t.view(1))])[0] for t in fed])
    assert_rel_close(decode, ref_decode, 1e-4, "decode after 8192 tokens")
    assert torch.equal(decode.argmax(-1)[:-1], fed[1:])


@pytest.fixture(scope="module")
def tiny_64k(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "tiny"
    write_random_checkpoint(path, tiny_text_config(max_position_embeddings=70000), seed=3)
    return path


def _greedy(path, kv: str, dtype: str, prompt: list[int]) -> list[int]:
    llm = LLM(str(path), tokenizer=None, dtype=dtype, kv_cache_dtype=kv, threads=2,
              max_model_len=len(prompt) + 16, max_num_seqs=1, max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_64k_prompt_tokens_with_int8_and_bf16_kv_equal_fp32_kv(tiny_64k):
    """A 65536-token prompt prefilled in chunks of 4096 and 8 greedy tokens after it: an fp32
    model's tokens with int8 KV equal its fp32 KV's; a bf16 model's with int8 KV equal its
    bf16 KV's."""
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(2, 97, (65536,), generator=gen).tolist()
    fp32 = _greedy(tiny_64k, "auto", "float32", prompt)
    assert _greedy(tiny_64k, "int8", "float32", prompt) == fp32
    bf16 = _greedy(tiny_64k, "auto", "bfloat16", prompt)
    assert _greedy(tiny_64k, "int8", "bfloat16", prompt) == bf16
