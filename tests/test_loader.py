"""Checkpoint loading: published / save_pretrained / sharded layouts, dtype, MTP, and errors
that name every offending tensor with its expected and found shape."""

from __future__ import annotations

import json
import socket

import pytest
import torch
from helpers import assert_rel_close, hf_prefill_decode, run_packed
from safetensors.torch import load_file, save_file

from hybridrt import CheckpointError, ConfigError, ModelNotFoundError, load_model
from hybridrt.bench.fixtures import (
    hf_reference_model,
    random_state_dict,
    tiny_text_config,
    write_random_checkpoint,
)
from hybridrt.config import ModelConfig
from hybridrt.loader import parse_dtype

TEXT = tiny_text_config()
CONFIG = ModelConfig.from_dict(TEXT)
SEED = 3
PREFIX = "model.language_model."


@pytest.fixture(scope="module")
def state_dict():
    return random_state_dict(CONFIG, seed=SEED)


@pytest.fixture(scope="module")
def reference(state_dict):
    return hf_reference_model(TEXT, state_dict)


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """The default layout: qwen3_5 + text_config, model.language_model.*, mtp.*, no lm_head."""
    return write_random_checkpoint(tmp_path_factory.mktemp("published"), TEXT, seed=SEED)


def matches_reference(net, reference, T: int = 21, steps: int = 3) -> None:
    prompt = torch.randint(0, CONFIG.vocab_size, (T,), generator=torch.Generator().manual_seed(T))
    ref_prefill, fed, ref_decode = hf_prefill_decode(reference, prompt, steps)
    (prefill,), (decode,) = run_packed(net, [prompt], [fed])
    assert_rel_close(prefill, ref_prefill, 1e-4, "prefill logits")
    assert_rel_close(decode, ref_decode, 1e-4, "decode logits")


def rewrite(path, edit) -> None:
    """Load model.safetensors, let ``edit`` change the dict, save it back."""
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_published_layout_loads_and_matches_transformers(published, state_dict, reference):
    raw = json.loads((published / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5" and "text_config" in raw
    names = load_file(str(published / "model.safetensors")).keys()
    assert any(n.startswith(PREFIX) for n in names) and any(n.startswith("mtp.") for n in names)
    assert "lm_head.weight" not in names

    net, config, path = load_model(published, dtype=torch.float32)
    assert path == published and config == CONFIG.__class__.from_dict(raw)
    assert not net.training and not any(p.requires_grad for p in net.parameters())
    for name, t in net.state_dict().items():
        assert torch.equal(t, state_dict[name]), name
    matches_reference(net, reference)


def test_transformers_save_pretrained_loads_and_matches(tmp_path, state_dict, reference):
    reference.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text"
    net, config, _ = load_model(tmp_path, dtype="float32")
    assert net.mtp is None  # transformers' causal LM has no MTP head
    assert config.layer_types == CONFIG.layer_types
    matches_reference(net, reference)


def test_sharded_checkpoint_loads(tmp_path, state_dict):
    write_random_checkpoint(tmp_path, TEXT, seed=SEED, num_shards=3)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert (tmp_path / "model.safetensors.index.json").is_file()
    net, _, _ = load_model(tmp_path, dtype=torch.float32)
    assert net.mtp is not None
    sd = net.state_dict()
    assert sd.keys() == state_dict.keys()
    for name, t in sd.items():
        assert torch.equal(t, state_dict[name]), name


def test_causal_lm_layout_with_flat_config_loads(tmp_path, state_dict):
    write_random_checkpoint(tmp_path, TEXT, seed=SEED, layout="causal_lm")
    net, _, _ = load_model(tmp_path, dtype=torch.float32)
    for name, t in net.state_dict().items():
        assert torch.equal(t, state_dict[name]), name


def test_vision_tensors_are_ignored(tmp_path, state_dict):
    write_random_checkpoint(tmp_path, TEXT, seed=SEED)

    def add_vision(t):
        t["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(96, 32)
        t["model.visual.patch_embed.proj.weight"] = torch.randn(32, 3, 2, 4, 4)
        t["model.visual.merger.linear_fc1.weight"] = torch.randn(7, 5)

    rewrite(tmp_path, add_vision)
    net, _, _ = load_model(tmp_path, dtype=torch.float32)
    assert not any("visual" in n for n in net.state_dict())
    assert torch.equal(net.model.embed_tokens.weight, state_dict["model.embed_tokens.weight"])


@pytest.mark.parametrize("dtype,expect", [
    ("bfloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16), ("bf16", torch.bfloat16),
    ("float32", torch.float32), ("fp32", torch.float32), (torch.float32, torch.float32),
], ids=lambda v: str(v).replace("torch.", ""))
def test_dtype_choice(published, state_dict, dtype, expect):
    net, _, _ = load_model(published, dtype=dtype)
    assert net.dtype == expect
    for name, t in net.state_dict().items():
        assert t.dtype == expect, name
        assert torch.equal(t, state_dict[name].to(expect)), name


def test_default_dtype_is_bf16(published):
    net, _, _ = load_model(published)
    assert {p.dtype for p in net.parameters()} == {torch.bfloat16}


def test_bad_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match="dtype"):
        parse_dtype(torch.int64)


def test_with_mtp_keeps_or_drops_mtp_weights(published, state_dict):
    with_mtp, _, _ = load_model(published, dtype=torch.float32, with_mtp=True)
    assert with_mtp.mtp is not None and len(with_mtp.mtp.layers) == CONFIG.mtp_num_hidden_layers
    mtp_names = [n for n in with_mtp.state_dict() if n.startswith("mtp.")]
    assert "mtp.fc.weight" in mtp_names and "mtp.layers.0.self_attn.q_proj.weight" in mtp_names
    for n in mtp_names:
        assert torch.equal(with_mtp.state_dict()[n], state_dict[n]), n
    without, _, _ = load_model(published, dtype=torch.float32, with_mtp=False)
    assert without.mtp is None
    assert not any(n.startswith("mtp.") for n in without.state_dict())


# ------------------------------------------------------------------------------------------
# Bad checkpoints
# ------------------------------------------------------------------------------------------


def test_missing_tensor_is_named_with_expected_shape(tmp_path):
    write_random_checkpoint(tmp_path, TEXT)
    rewrite(tmp_path, lambda t: t.pop(PREFIX + "layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    # named as the file's layout stores it, so that the user can look for it
    assert f"missing tensor: {PREFIX}layers.1.mlp.up_proj.weight" in msg
    assert str([CONFIG.intermediate_size, CONFIG.hidden_size]) in msg  # expected [88, 48]


def test_wrong_shapes_are_all_listed_in_one_error(tmp_path):
    write_random_checkpoint(tmp_path, TEXT)

    def damage(t):
        t[PREFIX + "layers.0.linear_attn.in_proj_qkv.weight"] = torch.randn(63, 48)  # 64 rows
        t[PREFIX + "layers.3.self_attn.k_norm.weight"] = torch.randn(13)  # head_dim 12

    rewrite(tmp_path, damage)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    # named as stored in the file, so that the user can find them
    qkv = msg[msg.index(PREFIX + "layers.0.linear_attn.in_proj_qkv.weight"):].splitlines()[0]
    assert "expected [64, 48]" in qkv and "found [63, 48]" in qkv
    norm = msg[msg.index(PREFIX + "layers.3.self_attn.k_norm.weight"):].splitlines()[0]
    assert "expected [12]" in norm and "found [13]" in norm


def test_unexpected_text_tensor_is_named(tmp_path):
    write_random_checkpoint(tmp_path, TEXT)
    rewrite(tmp_path, lambda t: t.__setitem__(PREFIX + "layers.2.mlp.extra_proj.weight",
                                              torch.randn(4, 4)))
    with pytest.raises(CheckpointError,
                       match=r"unexpected.*model\.language_model\.layers\.2\.mlp\.extra_proj"):
        load_model(tmp_path)


def test_unknown_model_type_is_a_config_error(tmp_path):
    write_random_checkpoint(tmp_path, TEXT)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["model_type"] = "llama"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="llama"):
        load_model(tmp_path)


def test_truncated_safetensors_is_a_checkpoint_error(tmp_path):
    write_random_checkpoint(tmp_path, TEXT)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert str(f) in str(e.value)  # the file's whole path


def test_missing_shard_file_is_a_checkpoint_error(tmp_path):
    write_random_checkpoint(tmp_path, TEXT, num_shards=3)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00003"):
        load_model(tmp_path)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """No network and an empty cache: nothing can be fetched or found."""
    import huggingface_hub.constants as hf_constants

    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(home / "hub"))
    # huggingface_hub reads these once at import; patch the live values too
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(home / "hub"), raising=False)
    monkeypatch.setattr(hf_constants, "HF_HOME", str(home), raising=False)
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("network disabled in tests")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    yield home
    assert not attempts, f"tried to reach the network: {attempts}"


def test_empty_model_path_says_so(offline_hub):
    with pytest.raises(ModelNotFoundError, match="the model path is empty"):
        load_model("")


def test_unknown_local_path_is_model_not_found(tmp_path, offline_hub):
    with pytest.raises(ModelNotFoundError, match="no-such-dir"):
        load_model(tmp_path / "no-such-dir")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path)  # a directory, but not a model
    assert not offline_hub.exists() or not any(offline_hub.rglob("*.safetensors"))


def test_unknown_hub_id_offline_is_model_not_found(offline_hub):
    with pytest.raises(ModelNotFoundError, match="hybridrt-test/does-not-exist"):
        load_model("hybridrt-test/does-not-exist")
    assert not offline_hub.exists() or not any(offline_hub.rglob("*.json"))
