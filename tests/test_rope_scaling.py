"""YaRN (Qwen3.5's context extension) from the config and through ``hf_overrides``, against
transformers' own YaRN at a tiny shape: logits within 1e-4 far past the original context, the
parameters checked, the override never ignored."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import assert_rel_close, build_pair, hf_prefill_decode, output_bytes, run_packed

from hybridrt.bench.fixtures import tiny_text_config
from hybridrt.config import ConfigError, ModelConfig, RopeScaling
from hybridrt.kernels.backend import CPUBackend
from hybridrt.kernels.rope import RopeRows, RopeTable, inv_freq, rope_cos_sin

TOL = 1e-4
ORIGINAL = 32  # the original context: the prompt below runs four times past it
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "factor": 4.0, "original_max_position_embeddings": ORIGINAL}


def yarn_config(**rope) -> dict:
    return tiny_text_config(rope_parameters={**YARN, **rope}, max_position_embeddings=ORIGINAL)


@pytest.mark.parametrize("rope", [{}, {"beta_fast": 16, "beta_slow": 2},
                                  {"attention_factor": 1.3}],
                         ids=["defaults", "betas", "attention-factor"])
def test_yarn_matches_transformers_past_the_original_context(rope):
    net, ref, config = build_pair(yarn_config(**rope))
    net.set_backend(CPUBackend(config))
    assert config.rope_scaling is not None
    prompt = torch.randint(0, config.vocab_size, (130,), generator=torch.Generator().manual_seed(3))
    ref_prefill, fed, ref_decode = hf_prefill_decode(ref, prompt, 8)
    (prefill,), (decode,) = run_packed(net, [prompt], [fed])
    assert_rel_close(prefill, ref_prefill, TOL, "prefill logits")
    for s in range(len(ref_decode)):
        assert_rel_close(decode[s], ref_decode[s], TOL, f"decode step {s}")


def test_yarn_frequencies_and_scale_are_transformers():
    from transformers import Qwen3_5TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = yarn_config(beta_fast=24)
    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    ref_freq, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours = ModelConfig.from_dict(cfg)
    freq = inv_freq(ours.rotary_dim, ours.rope_theta, ours.rope_scaling)
    assert torch.equal(freq, ref_freq.float())
    assert ours.rope_scaling.cos_sin_scale() == pytest.approx(ref_scale, rel=1e-12)
    # YaRN reaches factor x the original context
    assert ours.max_position_embeddings == 4 * ORIGINAL


def test_every_rope_table_scales_as_rope_cos_sin():
    """The CPU backend's tables (RopeRows; the batch-invariant RopeTable) take the scaling:
    RopeRows gives rope_cos_sin's bits, RopeTable its values to fp32 rounding."""
    scaling = ModelConfig.from_dict(yarn_config()).rope_scaling
    pos = torch.arange(0, 300)
    cos, sin = rope_cos_sin(pos, 32, 1e4, torch.float32, scaling)
    plain, _ = rope_cos_sin(pos, 32, 1e4, torch.float32)
    assert not torch.allclose(cos, plain)
    rows = RopeRows(32, 1e4, scaling)(pos, torch.float32)
    assert torch.equal(rows[0], cos) and torch.equal(rows[1], sin)
    table = RopeTable(32, 1e4, scaling)(pos, torch.float32)
    torch.testing.assert_close(table[0], cos, atol=2e-6, rtol=0)
    torch.testing.assert_close(table[1], sin, atol=2e-6, rtol=0)


PLAIN = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("layout", ["published", "causal_lm"])
def test_hf_overrides_apply_yarn_to_a_checkpoint_without_it(tmp_path, layout):
    """A checkpoint saved without YaRN, given it by hf_overrides (a dict or its JSON text;
    under text_config for the published layout, as vLLM's example), runs as the same weights
    saved with YaRN; without the override it runs plain RoPE (other logprobs) and refuses a
    context past the original one."""
    from hybridrt.bench.fixtures import write_random_checkpoint
    from hybridrt.llm import LLM
    from hybridrt.sampling_params import SamplingParams

    plain = write_random_checkpoint(tmp_path / "plain", tiny_text_config(
        rope_parameters=PLAIN, max_position_embeddings=ORIGINAL), layout=layout)
    yarn = write_random_checkpoint(tmp_path / "yarn", yarn_config(), layout=layout)
    override = {"rope_parameters": YARN}
    if layout == "published":
        override = {"text_config": override}
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    kw = dict(dtype="float32", tokenizer=None, cache_memory=32 << 20)

    def run(path, prompt, **extra):
        return output_bytes(LLM(str(path), **{**kw, **extra}).generate(
            [prompt], params, use_tqdm=False)[0])

    long, short = [3 + i % 90 for i in range(110)], list(range(3, 20))
    overridden = run(plain, long, max_model_len=128, hf_overrides=override)
    assert overridden == run(yarn, long, max_model_len=128)
    assert overridden == run(plain, long, max_model_len=128, hf_overrides=json.dumps(override))
    assert run(plain, short, max_model_len=ORIGINAL) != run(
        plain, short, max_model_len=ORIGINAL, hf_overrides=override)
    with pytest.raises(ValueError, match="max_model_len 128 exceeds"):
        LLM(str(plain), **kw, max_model_len=128)


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "yarn", "rope_theta": 1e4}, "needs 'factor'"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 0.5}, "factor must be >= 1"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2, "beta_fast": "x"},
     "beta_fast must be a number"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 2,
      "original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"rope_type": "longrope", "rope_theta": 1e4}, "'longrope' is not supported"),
])
def test_bad_rope_parameters_are_one_line_errors(rope, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(tiny_text_config(rope_parameters=rope))


@pytest.mark.parametrize("value, message", [("{not json", "not valid JSON"),
                                            ("[1, 2]", "must be a JSON object"),
                                            (3, "must be a JSON object")])
def test_bad_hf_overrides_are_one_line_errors(value, message):
    from hybridrt.engine_args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(hf_overrides=value)


def test_the_scale_follows_mscale_when_given():
    s = RopeScaling(factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                    mscale_all_dim=0.5)
    import math

    assert s.cos_sin_scale() == pytest.approx((0.1 * math.log(4) + 1) / (0.05 * math.log(4) + 1))
    assert RopeScaling(factor=1.0, original_max_position_embeddings=8).cos_sin_scale() == 1.0
