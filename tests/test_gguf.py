"""GGUF files made by llama.cpp's own converter from a tiny random checkpoint (three value heads
per key head, so the converter reorders them, and its reordering is not its own inverse; the
demo model's byte-level BPE tokenizer): config, tokenizer, every weight and greedy output
recovered; malformed files refused in one line before any weight is read (docs/gguf.md)."""

import struct

import gguf_convert
import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import (
    hf_reference_model,
    tiny_text_config,
    write_random_checkpoint,
)
from hybridrt.config import ModelConfig
from hybridrt.gguf import blocks, names, tensors
from hybridrt.gguf.reader import GGUFError, GGUFFile
from hybridrt.gguf.tokenizer import load_gguf_tokenizer
from hybridrt.kernels import quant
from hybridrt.loader import load_config, load_model
from hybridrt.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(gguf_convert.available() is not None,
                                reason=gguf_convert.available() or "")

CONFIG = tiny_text_config(
    vocab_size=6208, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
    linear_key_head_dim=16, linear_value_head_dim=32, eos_token_id=2)
FILES = {"f32_mtp": ("f32", True), "f32": ("f32", False), "bf16_mtp": ("bf16", True),
         "f16": ("f16", False), "q8_0_mtp": ("q8_0", True)}
TEXTS = ["Hello world! What does `json.dumps` do?\n\n  indented\tTabs 1234567 naïve café 日本語",
         "<think>\nx\n</think>\n\n<|im_end|><|im_start|>user\nhi", "don't I'LL we've\r\n\r\n  \n"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return gguf_convert.with_tokenizer(
        write_random_checkpoint(tmp_path_factory.mktemp("gguf-src"), CONFIG, seed=3))


@pytest.fixture(scope="module")
def files(ckpt, tmp_path_factory):
    """Every FILES entry converted by llama.cpp's converter (two at a time)."""
    return gguf_convert.convert_all(ckpt, tmp_path_factory.mktemp("gguf"), FILES)


@pytest.fixture(scope="module")
def original(ckpt):
    net, config, _ = load_model(ckpt, torch.float32, with_mtp=True)
    return net.state_dict(), config


def test_config_from_metadata(files, original):
    _, want = original
    for key in ("f32_mtp", "f32"):
        _, got, _ = load_model(files[key], "float32", with_mtp=False)
        for field in ModelConfig.__slots__:
            if field in ("eos_token_ids", "model_type"):
                continue
            expect = getattr(want, field)
            if field == "mtp_num_hidden_layers" and key == "f32":
                expect = 0  # converted with --no-mtp
            assert getattr(got, field) == expect, field
        assert 2 in got.eos_token_ids and 0 in got.eos_token_ids  # <|im_end|>, <|endoftext|>
        assert load_config(files[key]) == got  # what the benchmarks size caches by


def test_tokenizer_from_metadata_equals_the_original(files, ckpt):
    ours, theirs = load_gguf_tokenizer(files["f32"]), Tokenizer(ckpt)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": TEXTS[0]}]
    for thinking in (True, False):
        assert ours.apply_chat_template(chat, add_generation_prompt=True,
                                        enable_thinking=thinking) == \
            theirs.apply_chat_template(chat, add_generation_prompt=True,
                                       enable_thinking=thinking)
    assert (ours.eos_token, ours.pad_token) == (theirs.eos_token, theirs.pad_token)
    # the converter pads the vocabulary to the config's vocab_size with unused [PAD] tokens
    assert len(theirs) == 6148 and len(ours) == CONFIG["vocab_size"]
    assert [ours.decode([i]) for i in range(len(theirs))] == \
        [theirs.decode([i]) for i in range(len(theirs))]


@pytest.mark.parametrize("key", ["f32_mtp", "f32", "bf16_mtp", "f16"])
def test_float_weights_recovered_exactly(files, original, key):
    want, config = original
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[
        key.split("_")[0]]
    net, _, _ = load_model(files[key], "auto", with_mtp=True)
    assert net.dtype == dtype
    if not key.endswith("mtp"):
        assert net.mtp is None
        want = {k: v for k, v in want.items() if not k.startswith("mtp.")}
    gguf_convert.check_float_weights(net.state_dict(), want, config, dtype)


def _mapped_file(ptr: int) -> str | None:
    """The file whose mapping holds address ``ptr`` (/proc/self/maps), None if anonymous."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5] if len(parts) > 5 else None
    return None


def test_f32_weights_are_the_files_pages(files):
    """Memory-mapped, no copy: a weight the converter did not transform lies in the file's
    own mapping; a transformed one (a reordered projection) in process memory."""
    net, _, _ = load_model(files["f32"], "float32", with_mtp=False)
    assert _mapped_file(net.model.layers[0].mlp.up_proj.weight.data_ptr()) == \
        str(files["f32"])
    assert _mapped_file(net.model.embed_tokens.weight.data_ptr()) == str(files["f32"])
    assert _mapped_file(net.model.layers[0].linear_attn.in_proj_z.weight.data_ptr()) != \
        str(files["f32"])


def test_q8_0_is_int8_exactly(files, original):
    """Every Q8_0 weight becomes an int8 QuantWeight holding the file's values and scales:
    its dequantization equals gguf's numpy dequantization bit for bit."""
    want, config = original
    net, _, _ = load_model(files["q8_0_mtp"], "auto", with_mtp=True)
    f = GGUFFile(files["q8_0_mtp"])
    srcs = names.sources(config, True)
    packed = [(n, m.qweight) for n, m in net.named_modules()
              if isinstance(getattr(m, "qweight", None), quant.PackedWeight)]
    assert len(packed) == sum(w.dim() == 2 for w in want.values())  # linears, embedding
    from gguf.quants import dequantize

    for name, qw in packed:
        assert isinstance(qw, quant.QuantWeight), name
        src = srcs[f"{name}.weight"]
        t = f.tensors[src.name]
        ref = torch.from_numpy(dequantize(t.data, t.tensor_type)).view(qw.shape)
        assert torch.equal(qw.dequantize(), names.restore(ref, src)), name
        # and near the original weights (Q8_0's own error)
        orig = want[f"{name}.weight"]
        assert (qw.dequantize() - orig).abs().max() <= orig.abs().max() / 127, name


@pytest.mark.parametrize("key,spec", [("f32_mtp", 0), ("f32_mtp", 2), ("f32", 0)])
def test_greedy_equals_transformers_on_the_original(files, original, key, spec):
    sd, _ = original
    ref = hf_reference_model(CONFIG, sd, torch.float32)
    prompt = torch.randint(5, 6144, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(files[key], dtype="float32", max_model_len=64, max_num_seqs=2,
              cache_memory=8 << 20, speculative_tokens=spec)
    (out,) = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == ids[len(prompt):]
    assert llm.tokenizer is not None and llm.tokenizer.eos_token == "<|im_end|>"


def _header_patch(src, dst, patch) -> None:
    data = bytearray(src.read_bytes())
    patch(data)
    dst.write_bytes(bytes(data))


def _wrong_magic(data):
    data[:4] = b"GGML"


def _other_architecture(data):
    key = data.index(b"general.architecture")
    value = data.index(b"qwen35", key)
    data[value:value + 6] = b"mamba2"


def _wrong_shape(data):
    """blk.0.ffn_up.weight [128, 64] declared [64, 64] (its data still fits)."""
    at = data.index(b"blk.0.ffn_up.weight") + len(b"blk.0.ffn_up.weight")
    n_dims, ne0, ne1 = struct.unpack_from("<IQQ", data, at)
    assert (n_dims, ne0, ne1) == (2, 64, 128)
    struct.pack_into("<Q", data, at + 12, 64)


def _truncated_data(data):
    del data[len(data) * 2 // 3:]


def _truncated_header(data):
    del data[4096:]


def test_compiled_q8_0_repacking_gives_the_torch_paths_bytes(files, monkeypatch):
    """csrc/gguf_repack.c's Q8_0 (out_proj's value heads moved back in whole groups) writes
    the bytes the torch path writes."""
    from hybridrt.gguf import repack
    from hybridrt.kernels import native

    if native.load() is None:
        pytest.skip("no compiled kernels")

    def packed():
        net = load_model(files["q8_0_mtp"], "auto", with_mtp=True)[0]
        return {n: m.qweight for n, m in net.named_modules()
                if isinstance(getattr(m, "qweight", None), quant.PackedWeight)}

    fast = packed()
    monkeypatch.setattr(repack, "packed", lambda *a: None)
    slow = packed()
    assert fast.keys() == slow.keys() and any("out_proj" in n for n in fast)
    for name, qw in fast.items():
        assert all(torch.equal(x, y) for x, y in zip(qw.tensors(), slow[name].tensors())), name


def test_gguf_error_bench_finds_q8_0_and_f32_bit_exact(files, capsys):
    """``hybridrt bench gguf-error`` on the tiny Q8_0 file: every weight compared with gguf's
    dequantization, Q8_0 and F32 bit for bit."""
    from hybridrt.bench.gguf_error import run_gguf_error_bench

    (report,) = run_gguf_error_bench([files["q8_0_mtp"]])
    config = load_config(files["q8_0_mtp"])
    assert len(report["tensors"]) == len(names.sources(config, True))
    for kind in ("Q8_0", "F32"):
        s = report["types"][kind]
        assert s["exact"] == s["tensors"] > 0 and s["max_error"] == 0.0, kind
    out = capsys.readouterr().out
    assert "Q8_0     int8   " in out and out.count(" all") == len(report["types"])


def test_bench_throughput_on_a_gguf_against_llamacpp_on_the_same_file(files, tmp_path):
    """``hybridrt bench throughput X.gguf --against-llamacpp X.gguf``: hybridrt runs the GGUF
    file, llama.cpp (stand-in binaries, as tests/test_bench_llamacpp.py's) is handed the same
    file and the same work. (llama.cpp's own llama-bench does not load this tiny shape.)"""
    import json

    from test_bench_llamacpp import fake_llamacpp
    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    bins = fake_llamacpp(tmp_path / "bin")
    out = tmp_path / "tp.json"
    res = CliRunner().invoke(app, [str(a) for a in (
        "bench", "throughput", files["f32"], "--dtype", "float32", "--threads", "1",
        "--prefill-len", "16", "--prompt-len", "4", "--decode-tokens", "3",
        "--concurrency", "2,3", "--repeats", "1", "--no-transformers",
        "--against-llamacpp", files["f32"], "--llamacpp-bin", bins,
        "--order", "hybridrt,llamacpp", "--json", out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["model"] == str(files["f32"]) and r["llamacpp_run"]["gguf"] == str(files["f32"])
    assert set(r["ratio_vs_llamacpp"]) == set(r["llamacpp"]) <= set(r["hybridrt"])
    assert {"prefill_tok_s", "decode_b1_tok_s", "decode_b3_tok_s"} <= set(r["llamacpp"])
    assert r["work"]["llamacpp"]["decode_b3_tok_s"] == r["work"]["hybridrt"]["decode_b3_tok_s"]
    assert all(f"-m {files['f32']}" in a
               for a in (bins / "llama-bench.args").read_text().splitlines())


MALFORMED = {
    "wrong magic": (_wrong_magic, "not a GGUF file (magic b'GGML'"),
    "other architecture": (_other_architecture, "architecture 'mamba2' is not one hybridrt "
                                                "loads"),
    "wrong shape": (_wrong_shape, "tensor blk.0.ffn_up.weight has shape [64, 64], expected "
                                  "[128, 64]"),
    "truncated data": (_truncated_data, "truncated: tensor "),
    "truncated header": (_truncated_header, "malformed or truncated GGUF header"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_is_one_line_before_any_weight_is_read(files, tmp_path, monkeypatch,
                                                              case):
    patch, expected = MALFORMED[case]
    bad = tmp_path / "bad.gguf"
    _header_patch(files["f32"], bad, patch)

    def no_read(*args, **kwargs):
        raise AssertionError("a weight was read before the file was checked")

    for module, fn in ((tensors, "float_tensor"), (tensors, "dequantized"),
                       (blocks, "int8_groups"), (blocks, "nibble_groups"),
                       (blocks, "six_bit_groups")):
        monkeypatch.setattr(module, fn, no_read)
    with pytest.raises(GGUFError) as e:
        LLM(bad, dtype="float32", max_model_len=64, cache_memory=8 << 20)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and expected in msg, msg


def test_hf_overrides_are_refused_on_a_gguf_file(files):
    """A GGUF's settings are its metadata: hf_overrides on one is refused, never ignored."""
    from hybridrt.config import ConfigError
    from hybridrt.loader import load_config

    with pytest.raises(ConfigError, match="is a GGUF file, whose settings come from its"):
        LLM(str(files["f32"]), dtype="float32", hf_overrides={"rope_parameters": {}})
    with pytest.raises(ConfigError, match="is a GGUF file"):
        load_config(files["f32"], {"max_position_embeddings": 8})


def test_a_process_parses_a_files_header_once(files, tmp_path, monkeypatch):
    """The config, the weights, the tokenizer and every call's default sampling settings read
    a GGUF's header, parsed once per process (it was parsed four times at start-up and once
    per call without sampling params); the header kept holds no vocabulary (read from the
    mapped file when asked for); a file rewritten is parsed again."""
    import shutil

    from hybridrt.gguf import reader

    path = tmp_path / "m.gguf"
    shutil.copy(files["f32"], path)
    calls = []
    parse = reader._parse_header
    monkeypatch.setattr(reader, "_parse_header", lambda *a: calls.append(a) or parse(*a))
    llm = LLM(path, dtype="float32", max_model_len=64, cache_memory=8 << 20)
    for _ in range(2):
        llm.get_default_sampling_params()
    assert len(calls) == 1
    (metadata, _, _), = [h for k, h in reader._HEADERS.items() if k[0] == str(path.resolve())]
    assert isinstance(metadata["tokenizer.ggml.tokens"], reader._Deferred)
    tokens = GGUFFile(path).get("tokenizer.ggml.tokens")  # test_tokenizer_... reads them all
    assert len(tokens) == llm.config.vocab_size
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(calls) == 1
    # the config's end-of-generation ids are found without reading the vocabulary whole
    monkeypatch.setattr(reader._Deferred, "read", lambda *a: pytest.fail("read whole"))
    assert load_config(path).eos_token_ids == llm.config.eos_token_ids == [2, 0]
    path.write_bytes(path.read_bytes())
    GGUFFile(path)
    assert len(calls) == 2
