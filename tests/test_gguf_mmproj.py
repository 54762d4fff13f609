"""A GGUF model's vision tower from its mmproj projector file, both made by llama.cpp's own
converter from a tiny random Qwen3.5 checkpoint with a vision tower (tests/vision_helpers.py,
the demo model's BPE tokenizer with the vision tokens added): image embeddings equal to the
safetensors tower's, greedy output of an image prompt equal to the safetensors model's, the
projector found beside the model as llama-server picks one or given as ``mmproj``, malformed
projector files refused in one line before any weight is read (docs/gguf.md)."""

import shutil
import struct

import gguf_convert
import pytest
import torch
from helpers import assert_rel_close
from vision_helpers import image, text_config, write_vision_checkpoint

from hybridrt import LLM, SamplingParams
from hybridrt.engine_args import EngineArgs
from hybridrt.gguf import mmproj, tensors
from hybridrt.gguf.mmproj import find_mmproj, load_mmproj_tower
from hybridrt.gguf.reader import GGUFError, GGUFFile
from hybridrt.loader import load_config
from hybridrt.model_path import DEMO_MODEL_DIR

pytestmark = pytest.mark.skipif(gguf_convert.available() is not None,
                                reason=gguf_convert.available() or "")

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPT = f"<|im_start|>user\nA {IMG} and B {IMG}: same?<|im_end|>\n<|im_start|>assistant\n"
# sides multiples of patch x merge (8) within both processors' limits: the same grids
IMAGES = [image(40, 24, 1), image(24, 72, 2)]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = {"dtype": "float32", "max_model_len": 256, "cache_memory": "32MiB"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d, _ = write_vision_checkpoint(tmp_path_factory.mktemp("mmproj-src"), seed=3,
                                   text=text_config(vocab_size=6152, eos_token_id=2),
                                   tokenizer=DEMO_MODEL_DIR)
    return d


@pytest.fixture(scope="module")
def files(ckpt, tmp_path_factory):
    """{"model": the text model (F32) beside "mmproj" (F32) in one folder, "alone": the same
    model in a folder of its own, "q8_0": a Q8_0 projector elsewhere}."""
    out = tmp_path_factory.mktemp("mmproj")
    model = gguf_convert.convert(ckpt, out / "tiny-F32.gguf", "f32")
    proj = gguf_convert.convert(ckpt, out / "mmproj-tiny-F32.gguf", "f32", True, ("--mmproj",))
    other = tmp_path_factory.mktemp("mmproj-other")
    alone = other / "alone" / "tiny-F32.gguf"
    alone.parent.mkdir()
    shutil.copy(model, alone)
    q8 = gguf_convert.convert(ckpt, other / "projector-Q8_0.gguf", "q8_0", True, ("--mmproj",))
    return {"model": model, "mmproj": proj, "alone": alone, "q8_0": q8}


@pytest.fixture(scope="module")
def reference(ckpt):
    return LLM(ckpt, **KW)


def test_image_embeddings_equal_the_safetensors_towers(files, reference):
    llm = LLM(files["model"], **KW)
    assert llm.vision is not None and llm.vision.config == reference.vision.config
    ours = [llm.vision.image_item(im) for im in IMAGES]
    theirs = [reference.vision.image_item(im) for im in IMAGES]
    for a, b in zip(ours, theirs):
        assert a.grid == b.grid and torch.equal(a.pixels, b.pixels)
    assert_rel_close(llm.vision.encode(ours), reference.vision.encode(theirs), 1e-6)


def _generate(llm):
    (out,) = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES}}], GREEDY,
                          use_tqdm=False)
    assert out.error is None, out.error
    return out


def test_greedy_image_prompt_equals_the_safetensors_models(files, reference):
    want = _generate(reference)
    for llm in (LLM(files["model"], **KW), LLM(files["alone"], mmproj=files["mmproj"], **KW)):
        got = _generate(llm)
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_model_without_a_projector_refuses_images(files):
    llm = LLM(files["alone"], **KW)
    assert llm.vision is None
    (out,) = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": IMAGES}}], GREEDY,
                          use_tqdm=False)
    assert "this model has no vision tower" in str(out.error)


def test_q8_0_projector_is_ggufs_dequantization(files, reference):
    from gguf.quants import dequantize

    f = GGUFFile(files["q8_0"], architectures=("clip",))
    assert f.tensors["v.blk.0.attn_qkv.weight"].tensor_type.name == "Q8_0"
    tower = load_mmproj_tower(files["alone"], load_config(files["alone"]), torch.float32,
                              mmproj=files["q8_0"])
    state = tower.encoder.state_dict()
    for ours, theirs in mmproj._sources(tower.config).items():
        t = f.tensors[theirs]
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type)).view(GGUFFile.shape(t))
        assert torch.equal(state[ours], ref), ours
    assert torch.equal(state["patch_embed.proj.weight"],  # the converter keeps it F32
                       reference.vision.encoder.state_dict()["patch_embed.proj.weight"])


def test_find_mmproj_as_llama_server_picks_one(tmp_path):
    model = tmp_path / "Qwen3.5-0.8B-Q8_0.gguf"
    model.touch()
    assert find_mmproj(model) is None
    for name in ("mmproj-Qwen3.5-0.8B-F32.gguf", "mmproj-Qwen3.5-0.8B-BF16.gguf",
                 "mmproj-Qwen3.5-0.8B-F16.gguf", "notes-mmproj.txt"):
        (tmp_path / name).touch()
    assert find_mmproj(model).name == "mmproj-Qwen3.5-0.8B-BF16.gguf"  # |16 - 8| < |32 - 8|
    assert find_mmproj(tmp_path / "Qwen3.5-0.8B-F32.gguf").name == "mmproj-Qwen3.5-0.8B-F32.gguf"


def _truncated(data):
    del data[len(data) * 2 // 3:]


def _wrong_magic(data):
    data[:4] = b"GGML"


def _other_projector(data):
    at = data.index(b"qwen3vl_merger")
    data[at:at + 14] = b"qwen2vl_merger"


def _wrong_shape(data):
    """v.blk.0.ffn_up.weight [40, 32] declared [20, 32] (its data still fits)."""
    name = b"v.blk.0.ffn_up.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    assert struct.unpack_from("<IQQ", data, at) == (2, 32, 40)
    struct.pack_into("<Q", data, at + 12, 20)


MALFORMED = {
    "truncated": (_truncated, "truncated: tensor "),
    "wrong magic": (_wrong_magic, "not a GGUF file (magic b'GGML'"),
    "other projector": (_other_projector, "projector type 'qwen2vl_merger' is not one "
                                          "hybridrt runs"),
    "wrong shape": (_wrong_shape, "tensor v.blk.0.ffn_up.weight has shape [20, 32], expected "
                                  "[40, 32]"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_projector_is_one_line_before_any_weight_is_read(files, tmp_path,
                                                                   monkeypatch, case):
    patch, expected = MALFORMED[case]
    data = bytearray(files["mmproj"].read_bytes())
    patch(data)
    bad = tmp_path / "bad-mmproj.gguf"
    bad.write_bytes(bytes(data))

    def no_read(*args, **kwargs):
        raise AssertionError("a weight was read before the file was checked")

    monkeypatch.setattr(tensors, "dequantized", no_read)
    with pytest.raises(GGUFError) as e:
        load_mmproj_tower(files["alone"], load_config(files["alone"]), torch.float32,
                          mmproj=bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and expected in msg, msg


def test_mmproj_option_mistakes_are_one_line(files, ckpt):
    with pytest.raises(ValueError, match="mmproj is a GGUF model's vision projector, but "
                                         "model .* is not a GGUF file"):
        EngineArgs(model=str(ckpt), mmproj=str(files["mmproj"]))
    with pytest.raises(ValueError, match="mmproj must be the path of a projector file"):
        EngineArgs(model=str(files["model"]), mmproj=str(files["model"]) + ".missing")
    with pytest.raises(GGUFError, match=r"a mmproj file of 'clip' is not one hybridrt loads "
                                        r"here .* give it as mmproj beside its model"):
        LLM(files["mmproj"], **KW)


def test_cli_mmproj_flag(files, ckpt):
    from hybridrt.cli.common import CliError
    from hybridrt.cli.options import ModelOptions

    opts = ModelOptions(model=str(files["alone"]), mmproj=str(files["mmproj"])).checked()
    assert opts.llm_kwargs()["mmproj"] == str(files["mmproj"])
    assert "--mmproj" in opts.flags()
    with pytest.raises(CliError, match="is not a GGUF file"):
        ModelOptions(model=str(ckpt), mmproj=str(files["mmproj"])).checked()
