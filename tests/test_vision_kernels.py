"""The vision tower on the text model's kernels (``hybridrt.vision.kernels``): the CPU
backend's products and the CPU flash attention against transformers (fp32 and bf16, both bf16
product paths), the int8 tower (``vision_quantization``) on the int8 GEMM within its measured
error, the option's refusals, and the error benchmark kept runnable."""

from __future__ import annotations

import json

import pytest
import torch
from vision_helpers import (
    VISION,
    bf16_tower_runs,
    image,
    max_rel_err,
    write_vision_checkpoint,
)

from hybridrt import LLM, SamplingParams
from hybridrt.kernels import quant
from hybridrt.kernels.backend import select_backend
from hybridrt.vision.config import VisionConfig
from hybridrt.vision.encoder import VisionEncoder
from hybridrt.vision.kernels import quantize_tower

IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("kernels"), seed=7)


class Recording:
    """A backend that records the weights its ``linear`` is given."""

    def __init__(self, backend):
        self.inner, self.weights = backend, []

    def linear(self, x, w):
        self.weights.append(w)
        return self.inner.linear(x, w)


def test_the_cpu_backend_tower_matches_transformers_in_fp32(ckpt):
    """Mixed grids and two frames (attention per image and frame) on the backend's products
    and the flash kernel: within 1e-4 of transformers, every product through the backend."""
    ref = ckpt[1].model.visual
    cfg = VisionConfig(**VISION, out_hidden_size=ref.merger.linear_fc2.out_features)
    ours = VisionEncoder(cfg)
    ours.load_state_dict(ref.state_dict())
    rec = Recording(select_backend(None, "cpu"))
    ours.set_backend(rec)
    grids = [(1, 6, 4), (1, 4, 10), (2, 2, 2), (1, 16, 16)]
    n = sum(t * h * w for t, h, w in grids)
    px = torch.randn(n, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(px, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(px, grids)
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    assert len(rec.weights) == 4 * cfg.depth + 2  # qkv, proj, fc1, fc2 a block; the merger's


@pytest.mark.parametrize("onednn_half", [True, False], ids=["onednn", "backend-bf16"])
def test_08b_widths_in_bf16_on_the_cpu_backend_within_bf16_of_transformers(onednn_half):
    """The 0.8B's vision widths (two blocks), random bf16 weights, a 448x448 image, on the CPU
    backend: within bf16 rounding of transformers' bf16 run and as close to the fp32 result
    as it is, with the half products on oneDNN and on the backend's bf16 GEMM."""
    def prepare(ours):
        ours.to(torch.bfloat16).set_backend(select_backend(None, "cpu"))
        ours.merger.kernels.onednn_half = onednn_half  # one VisionKernels for every module
        return ours

    got, want, exact = bf16_tower_runs(3, prepare)
    assert max_rel_err(got, want) < 2e-2
    assert max_rel_err(got, exact) < 2 * max_rel_err(want, exact) + 1e-3


def test_int8_tower_runs_on_the_int8_gemm_within_its_measured_error():
    """quantize_tower("int8"): every linear holds int8 weights (no bf16 copy), the products go
    to the backend as QuantWeights, and the embeddings stay within the error docs/vision.md
    gives (0.8B widths, one block: relative L2 error under 3%, every token's cosine > 0.999)."""
    from hybridrt.bench.vision import QWEN35_08B_VISION, grid_of, random_encoder

    cfg = VisionConfig(**{**QWEN35_08B_VISION, "depth": 1})
    grid = grid_of(cfg, 224, 160)
    px = torch.randn(grid[1] * grid[2], 1536, generator=torch.Generator().manual_seed(2))
    base = random_encoder(cfg, torch.bfloat16)
    base.set_backend(select_backend(None, "cpu"))
    enc = random_encoder(cfg, torch.bfloat16)
    quantize_tower(enc, "int8")
    linears = [m for m in enc.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight is None and isinstance(m.qweight, quant.QuantWeight)
                           for m in linears)
    rec = Recording(select_backend(None, "cpu"))
    enc.set_backend(rec)
    with torch.inference_mode():
        want, got = base(px, [grid]).double(), enc(px, [grid]).double()
    assert len(rec.weights) == len(linears)
    assert all(isinstance(w, quant.QuantWeight) for w in rec.weights)
    assert (got - want).norm() / want.norm() < 0.03
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999


def test_llm_vision_quantization_int8_quantizes_only_the_tower(ckpt):
    """LLM(vision_quantization="int8"): the tower's linears in int8 on the engine's backend,
    the text model untouched, and an image request runs; its embeddings are close to those
    of the tower in the model's dtype."""
    plain = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB")
    llm = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
              vision_quantization="int8")
    assert quant.quantization_of(llm.model) is None
    enc = llm.vision.encoder
    assert all(isinstance(m.qweight, quant.QuantWeight) for m in enc.modules()
               if isinstance(m, torch.nn.Linear))
    assert enc.merger.kernels.backend is llm.engine.runner.backend
    img = image(40, 24, 1)
    out = llm.generate([{"prompt": f"{IMG}?", "multi_modal_data": {"image": [img]}}],
                       SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 2
    items = [plain.vision.image_item(img)]
    want, got = plain.vision.encode(items).double(), llm.vision.encode(items).double()
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.99


def test_vision_quantization_refusals(ckpt, tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'int5'"):
        LLM(ckpt[0], vision_quantization="int5")
    with pytest.raises(ValueError, match="'int4' is not offered: the tower's embeddings"):
        LLM(ckpt[0], vision_quantization="int4")
    with pytest.raises(ValueError, match="language_model_only leaves unloaded"):
        LLM(ckpt[0], vision_quantization="int8", language_model_only=True)
    with pytest.raises(ValueError, match="runs on the CPU backends only"):
        LLM(ckpt[0], vision_quantization="int8", backend="triton")
    from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint

    text_only = write_random_checkpoint(tmp_path, tiny_text_config(), seed=0)
    with pytest.raises(ValueError, match="has no vision tower"):
        LLM(str(text_only), dtype="float32", max_model_len=64, cache_memory="16MiB",
            tokenizer=None, vision_quantization="int8")


def test_cli_vision_quantization_flag_is_checked_before_loading(ckpt):
    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    res = CliRunner().invoke(app, ["chat", str(ckpt[0]), "--vision-quantization", "int5"])
    assert res.exit_code == 2
    assert "--vision-quantization: unknown quantization 'int5'" in res.stderr


def test_error_bench_runs(capsys):
    from hybridrt.bench import vision_error

    tiny = json.dumps({**VISION, "out_hidden_size": 16})
    vision_error.main(["--size", "64x64", "--config", tiny])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["format"] for r in rows] == ["bf16", "int8", "int4"]
    assert rows[0]["vs_bf16"]["rel_l2"] == 0 and 0 < rows[0]["vs_fp32"]["rel_l2"] < 0.05
    assert 0 < rows[1]["vs_bf16"]["rel_l2"] < rows[2]["vs_bf16"]["rel_l2"]


def test_encoder_bench_options_run(capsys):
    """--kernels torch and --quantization int8 time the same shape."""
    from hybridrt.bench import vision

    tiny = json.dumps({**VISION, "out_hidden_size": 16})
    for flags in (["--kernels", "torch"], ["--quantization", "int8"]):
        vision.main(["--sizes", "40x24", "--config", tiny, *flags])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["tokens"] for r in rows] == [15, 15] and all(r["seconds"] > 0 for r in rows)


def test_llamacpp_checkpoint_holds_the_benchmarked_weights(tmp_path):
    """write_checkpoint's tower is random_encoder's (what the bench times), loadable as a
    checkpoint, with a text model of the tower's output width and the vision token ids."""
    from hybridrt.bench.vision import random_encoder, write_checkpoint
    from hybridrt.loader import load_config
    from hybridrt.vision.load import load_vision_tower

    vision = {**VISION, "out_hidden_size": 64}
    ckpt = write_checkpoint(tmp_path / "ckpt", vision, seed=4)
    text = load_config(ckpt)
    assert text.hidden_size == 64
    tower = load_vision_tower(ckpt, text, torch.bfloat16)
    want = random_encoder(VisionConfig(**vision), torch.bfloat16, seed=4).state_dict()
    got = tower.encoder.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert cfg["image_token_id"] == added["<|image_pad|>"] < text.vocab_size


def test_llamacpp_comparison_reads_mtmd_timings(tmp_path, capsys, monkeypatch):
    """--llamacpp DIR: both conversions, then one mtmd run per size; its encode time beside
    ours and the ratio (a stand-in for llamacpp-bench here)."""
    from hybridrt.bench import vision

    tool = tmp_path / "llamacpp-bench"
    log = tmp_path / "calls"
    tool.write_text("#!/usr/bin/env bash\n"
                    f"echo \"$1\" >> {log}\n"
                    "case \"$1\" in\n"
                    "  convert|convert-mmproj) echo gguf > \"$3\" ;;\n"
                    "  mtmd) case \"$4\" in *40x24*) echo 'mtmd batch encoding done in 500 ms' ;;\n"
                    "    *) echo 'image slice encoded in 250 ms'; echo 'image slice encoded in "
                    "250 ms'; echo 'mtmd batch encoding done in 501 ms' ;; esac ;;\n"
                    "esac\n")
    tool.chmod(0o755)
    monkeypatch.setenv("HYBRIDRT_LLAMACPP_BENCH", str(tool))
    tiny = json.dumps({**VISION, "out_hidden_size": 16})
    vision.main(["--sizes", "40x24,64x64", "--config", tiny, "--threads", "1",
                 "--llamacpp", str(tmp_path / "work")])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # the batch's time; two slices summed where they are printed
    assert [r["llamacpp_seconds"] for r in rows] == [0.5, 0.5]
    assert all(r["ratio"] == pytest.approx(0.5 / r["seconds"]) for r in rows)
    calls = [line.split()[0] for line in log.read_text().splitlines()]
    assert calls == ["convert", "convert-mmproj", "mtmd", "mtmd"]
