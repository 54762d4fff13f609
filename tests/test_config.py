"""ModelConfig: both config.json forms, layer pattern, RoPE fields, eos ids, and errors that
name the offending field."""

from __future__ import annotations

import copy
import json

import pytest

from hybridrt.bench.fixtures import QWEN35_08B_TEXT_CONFIG, published_config, tiny_text_config
from hybridrt.config import ConfigError, ModelConfig
from hybridrt.loader import load_config

LIN, FULL = "linear_attention", "full_attention"


def test_published_and_flat_forms_agree():
    flat = ModelConfig.from_dict(QWEN35_08B_TEXT_CONFIG)
    nested = ModelConfig.from_dict(published_config(QWEN35_08B_TEXT_CONFIG))
    assert flat.model_type == "qwen3_5_text" and nested.model_type == "qwen3_5"
    nested.model_type = flat.model_type
    assert nested == flat


def test_qwen35_08b_sizes():
    c = ModelConfig.from_dict(published_config(QWEN35_08B_TEXT_CONFIG))
    assert (c.vocab_size, c.hidden_size, c.intermediate_size) == (248320, 1024, 3584)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (8, 2, 256)
    assert c.full_attention_layers == [3, 7, 11, 15, 19, 23]
    assert c.linear_attention_layers == [i for i in range(24) if i % 4 != 3]
    assert c.layer_types == [LIN, LIN, LIN, FULL] * 6
    assert c.rotary_dim == 64 and c.rope_theta == 1e7 and c.partial_rotary_factor == 0.25
    assert (c.linear_key_dim, c.linear_value_dim, c.conv_dim) == (2048, 2048, 6144)
    assert c.linear_conv_kernel_dim == 4 and c.mtp_num_hidden_layers == 1
    assert c.tie_word_embeddings is True and c.rms_norm_eps == 1e-6
    assert c.eos_token_ids == [248044]


def test_tie_word_embeddings_read_from_the_top_level_of_the_published_form():
    text = dict(QWEN35_08B_TEXT_CONFIG, tie_word_embeddings=False)
    assert ModelConfig.from_dict(published_config(text)).tie_word_embeddings is False
    assert ModelConfig.from_dict(published_config(QWEN35_08B_TEXT_CONFIG)).tie_word_embeddings


@pytest.mark.parametrize("interval,n,full", [(4, 8, [3, 7]), (2, 5, [1, 3]), (1, 3, [0, 1, 2]),
                                             (6, 4, [])], ids=lambda v: str(v))
def test_full_attention_interval_builds_layer_types(interval, n, full):
    raw = tiny_text_config(num_hidden_layers=n)
    del raw["layer_types"]
    raw["full_attention_interval"] = interval
    c = ModelConfig.from_dict(raw)
    assert c.full_attention_layers == full
    assert len(c.layer_types) == n


def test_layer_types_win_over_interval():
    types = [FULL, LIN, LIN, FULL, LIN]
    raw = tiny_text_config(num_hidden_layers=5, layer_types=types, full_attention_interval=4)
    c = ModelConfig.from_dict(raw)
    assert c.layer_types == types and c.full_attention_layers == [0, 3]
    assert c.linear_attention_layers == [1, 2, 4]


def test_layer_types_match_transformers():
    from transformers import Qwen3_5TextConfig

    raw = copy.deepcopy(QWEN35_08B_TEXT_CONFIG)
    raw.pop("model_type")
    assert ModelConfig.from_dict(QWEN35_08B_TEXT_CONFIG).layer_types == \
        Qwen3_5TextConfig(**raw).layer_types


def test_rope_parameters_fields():
    raw = tiny_text_config(head_dim=16, rope_parameters={
        "rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.375,
        "mrope_section": [1, 1, 1], "mrope_interleaved": True})
    c = ModelConfig.from_dict(raw)
    assert c.rope_theta == 5e5 and c.partial_rotary_factor == 0.375 and c.rotary_dim == 6


def test_rope_fields_at_top_level_and_defaults():
    raw = tiny_text_config(head_dim=16, rope_theta=1234.0, partial_rotary_factor=0.5)
    del raw["rope_parameters"]
    c = ModelConfig.from_dict(raw)
    assert c.rope_theta == 1234.0 and c.rotary_dim == 8
    del raw["rope_theta"], raw["partial_rotary_factor"]
    c = ModelConfig.from_dict(raw)  # Qwen3.5 defaults
    assert c.rope_theta == 1e7 and c.partial_rotary_factor == 0.25 and c.rotary_dim == 4


def test_unsupported_rope_type_is_rejected():
    """yarn is supported (tests/test_rope_scaling.py); other scalings are refused by name."""
    raw = tiny_text_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                            "factor": 4})
    with pytest.raises(ConfigError, match="'dynamic' is not supported"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("gen_eos,expect", [
    ([248046, 248044], [248044, 248046]),
    (248046, [248044, 248046]),
    (248044, [248044]),
], ids=["list", "int", "duplicate"])
def test_eos_ids_merged_from_generation_config(tmp_path, gen_eos, expect):
    (tmp_path / "config.json").write_text(json.dumps(published_config(QWEN35_08B_TEXT_CONFIG)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": gen_eos}))
    assert load_config(tmp_path).eos_token_ids == expect


def test_eos_ids_without_generation_config(tmp_path):
    raw = tiny_text_config(eos_token_id=[1, 2])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert load_config(tmp_path).eos_token_ids == [1, 2]


def _broken(**changes):
    raw = tiny_text_config()
    for k, v in changes.items():
        if v is None:
            del raw[k]
        else:
            raw[k] = v
    return raw


@pytest.mark.parametrize("changes,field", [
    ({"num_attention_heads": 5}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ({"layer_types": [LIN, FULL]}, "layer_types"),
    ({"layer_types": [LIN, "mamba", LIN, FULL]}, "mamba"),
    ({"hidden_size": None}, "hidden_size"),
    ({"vocab_size": None}, "vocab_size"),
    ({"linear_num_key_heads": None}, "linear_num_key_heads"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"intermediate_size": 0}, "intermediate_size"),
    ({"head_dim": -4}, "head_dim"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attn_output_gate": False}, "attn_output_gate"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1.5}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25}}, "rotary dim"),
    ({"model_type": "qwen2"}, "model_type"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_inconsistent_configs_name_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(_broken(**changes))


def test_published_form_needs_text_config():
    raw = published_config(tiny_text_config())
    del raw["text_config"]
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict(raw)
    raw = published_config(tiny_text_config())
    raw["text_config"]["model_type"] = "qwen3_next"
    with pytest.raises(ConfigError, match="qwen3_next"):
        ModelConfig.from_dict(raw)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_file(tmp_path / "config.json")
    (tmp_path / "config.json").write_text(json.dumps(tiny_text_config()))
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="generation_config.json"):
        load_config(tmp_path)
