"""int8 weights (kernels/quant.py, csrc/int8_gemm.c): quantization, every kernel path against
torch references for every tile shape and tail, the quantized model against a model holding the
dequantized weights, speculative decoding, memory, bad input."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import PackedRunner, assert_rel_close
from typer.testing import CliRunner

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_random_checkpoint
from hybridrt.cli.main import app
from hybridrt.kernels import quant
from hybridrt.kernels.backend import CPUBackend, ReferenceBackend
from hybridrt.loader import load_model, save_quantized

ISAS = quant.available_isas()
needs_kernels = pytest.mark.skipif(not ISAS, reason="compiled kernels unavailable")


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tests/conftest.py


# Quantization ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(1, 32), (16, 64), (17, 40), (50, 96), (33, 7)],
                         ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_quantize_round_trip_error_bound(shape):
    """Every weight comes back within half a step of its group's scale (plus the fp16 rounding
    of that scale where the largest value is clamped to 127); rows() agrees with dequantize()."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3
    w[0, :min(32, shape[1])] = 0  # an all-zero group: scale 0, values 0
    qw = quant.quantize(w.bfloat16())
    deq = qw.dequantize()
    assert deq.shape == w.shape
    N, K = shape
    Kp = -(-K // 32) * 32
    wp = torch.nn.functional.pad(w.bfloat16().float(), (0, Kp - K)).view(N, -1, 32)
    amax = wp.abs().amax(-1, keepdim=True)
    step = amax / 127
    err = (torch.nn.functional.pad(deq, (0, Kp - K)).view(N, -1, 32) - wp).abs()
    assert (err <= step / 2 + amax * 2**-10 + 1e-12).all()
    assert deq[0, :min(32, K)].abs().max() == 0
    ids = torch.tensor([[N - 1, 0], [N // 2, N - 1]])
    assert torch.equal(qw.rows(ids), deq[ids])
    assert qw.qs.dtype == torch.int8 and qw.scales.dtype == torch.float16
    before = w.clone()
    assert torch.equal(quant.quantize(w).qs, quant.quantize(w.double()).qs)
    assert torch.equal(w, before)  # the input is left as it was


def test_quantize_rejects_non_float_matrices():
    with pytest.raises(ValueError, match="float matrix"):
        quant.quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="float matrix"):
        quant.quantize(torch.ones(32))


# Kernels -----------------------------------------------------------------------------------
# rows: 1-8 (one tile of all rows), 9 and 33 (tiles of 4 and each tail); columns: below, at and
# past one and two panels (a tile of 4 rows is two panels of 16); inputs: one group, several,
# long
ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 33]
COLS = [1, 15, 16, 17, 33, 48, 70]
INPUTS = [32, 96, 1024]


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K", INPUTS, ids=lambda k: f"K{k}")
def test_kernel_matches_torch_references(isa, K):
    """Each path, every (rows, columns) shape: against the kernels' math done in torch (exact
    integer group sums, so to fp32 rounding) and against plain dequantize-then-matmul (within
    what quantizing the activations costs)."""
    g = torch.Generator().manual_seed(K)
    for N in COLS:
        w = torch.randn(N, K, generator=g)
        qw = quant.quantize(w)
        deq = qw.dequantize()
        for M in ROWS:
            x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
            y = quant.int8_gemm(x, qw, isa)
            what = f"{isa} M{M} N{N} K{K}"
            assert_rel_close(y, quant.emulate(x, qw), 1e-5, what)
            ref = x @ deq.T
            assert ((y - ref).norm() / ref.norm()).item() < 2e-2, what


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_kernel_rows_do_not_depend_on_the_batch(isa):
    """A row's output is bit-identical whether it runs alone or in any batch (what makes
    speculative verification reproduce plain decoding exactly): at every position among 1 to 9
    rows (one tile of up to 8 rows, then tiles of 4), against the same rows among 11, in fp32
    and in bf16, a partial last panel included."""
    g = torch.Generator().manual_seed(1)
    qw = quant.quantize(torch.randn(50, 160, generator=g))
    x = torch.randn(11, 160, generator=g)
    xb = x.bfloat16()
    whole, whole_bf16 = quant.int8_gemm(x, qw, isa), quant.linear(xb, qw, isa)
    for m in range(1, 10):
        for i in range(0, 11 - m + 1):
            assert torch.equal(quant.int8_gemm(x[i:i + m], qw, isa), whole[i:i + m]), (m, i)
            assert torch.equal(quant.linear(xb[i:i + m], qw, isa), whole_bf16[i:i + m]), (m, i)


@needs_kernels
def test_kernel_pads_inputs_that_are_not_a_multiple_of_32():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(20, 45, generator=g), torch.randn(3, 45, generator=g)
    qw = quant.quantize(w)
    y = quant.linear(x.bfloat16(), qw, ISAS[-1])
    assert y.dtype == torch.bfloat16 and y.shape == (3, 20)
    assert_rel_close(y.float(), quant.emulate(x.bfloat16().float(), qw), 1e-2)
    with pytest.raises(ValueError, match=r"x must be \[M, 45\]"):
        quant.int8_gemm(torch.randn(3, 44), qw, ISAS[-1])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("K", [45, 96], ids=lambda k: f"K{k}")
def test_bf16_activations_in_one_call(isa, K):
    """bf16 x [M, K] (the decode loop's products) in one call: bit for bit the fp32 path's
    result rounded to bf16, the padding of K to a multiple of 32 included."""
    g = torch.Generator().manual_seed(K)
    qw = quant.quantize(torch.randn(37, K, generator=g))
    for M in (1, 3, 6, 8, 9):
        x = (torch.randn(M, K, generator=g) * 0.05).bfloat16()  # |x| < 1: padding shows
        y = quant.linear(x, qw, isa)
        assert y.dtype == torch.bfloat16 and y.shape == (M, 37)
        assert torch.equal(y, quant.int8_gemm(x.float(), qw, isa).to(torch.bfloat16)), M


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_quantization_is_the_reference(isa, dtype):
    """Each path's quantization of the rows (vectorised on AVX-512 builds, plain C for "ref"):
    bit for bit ``quantize_activations``, ties rounded to even, an all-zero group, a row ending
    inside a group (zeros past K) included."""
    g = torch.Generator().manual_seed(3)
    for K in (32, 45, 96, 1000):
        x = torch.randn(5, K, generator=g) * torch.rand(5, 1, generator=g) * 4
        x[1, :32] = 0  # an all-zero group: d = 0, q = 0
        x[2, :32] = torch.arange(32) - 15.5  # amax 15.5 -> x * 127 / 15.5: halves, ties
        x = x.to(dtype)
        q, d, s = quant.kernel_quantize_activations(x, isa)
        ref_q, ref_d = quant.quantize_activations(F.pad(x.float(), (0, q.shape[1] - K)))
        assert torch.equal(q.float(), ref_q), (isa, K)
        assert torch.equal(d, ref_d), (isa, K)
        assert torch.equal(s, ref_q.view(5, -1, 32).sum(-1).int()), (isa, K)


@needs_kernels
def test_isa_switch():
    """HYBRIDRT_INT8_ISA -> the int8 path (read by hybridrt/env.py, handed to the backend)."""
    from hybridrt.env import kernel_options

    opts = kernel_options({"HYBRIDRT_INT8_ISA": "ref"})
    assert quant.select_isa(opts.int8_isa) == "ref"
    assert CPUBackend(None, options=opts).int8_isa == "ref"
    with pytest.raises(ValueError, match="HYBRIDRT_INT8_ISA='sse9': choose one of ref"):
        kernel_options({"HYBRIDRT_INT8_ISA": "sse9"})
    with pytest.raises(ValueError, match="HYBRIDRT_INT8_ISA='sse9': choose one of ref"):
        quant.select_isa("sse9")
    assert quant.select_isa(kernel_options({}).int8_isa) == ISAS[-1]


# The quantized model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny model whose inputs (48, 24, 88, 96) are mostly not multiples of 32, bf16."""
    cfg = tiny_text_config(vocab_size=131)
    return write_random_checkpoint(tmp_path_factory.mktemp("int8"), cfg, seed=5,
                                   dtype=torch.bfloat16)


def _logits(net, prompts):
    runner = PackedRunner(net, len(prompts), 40, block_size=8)
    first = runner.step(list(enumerate(prompts)))
    nxt = [(i, torch.tensor([3 + i])) for i in range(len(prompts))]
    return torch.cat([*first, *runner.step(nxt)])


def _dequantized_model(ckpt):
    """The checkpoint in fp32 with every weight int8 quantizes replaced by its dequantized
    values, on the reference backend."""
    net, config, _ = load_model(ckpt, torch.float32)
    names = quant.quantized_names(net)
    for name, p in net.named_parameters():
        if name in names:
            p.copy_(quant.quantize(p.bfloat16()).dequantize())
    net.set_backend(ReferenceBackend(config))
    return net


PROMPTS = [torch.tensor([5, 9, 2, 77, 31, 8, 100]), torch.tensor([40, 41, 3])]


class _EmulatedBackend(ReferenceBackend):
    """The reference backend with the int8 kernels' math (``quant.emulate``) for quantized
    weights."""

    def linear(self, x, w):
        if not isinstance(w, quant.QuantWeight):
            return super().linear(x, w)
        return quant.emulate(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], -1).to(x.dtype)


def test_quantized_model_matches_dequantized_reference(ckpt):
    """On the reference backend the int8 model computes exactly what a model holding the
    dequantized weights does. On the CPU backend (activations quantized per group too) it
    computes what the kernels' math done in torch gives, and stays near the dequantized model:
    on this tiny random model quantizing the activations moves the logits less than bf16
    weights alone do, well inside the bound below."""
    ref = _logits(_dequantized_model(ckpt), PROMPTS)
    net, config, _ = load_model(ckpt, torch.float32, quantization="int8")
    net.set_backend(ReferenceBackend(config))
    assert torch.equal(_logits(net, PROMPTS), ref)
    net.set_backend(_EmulatedBackend(config))
    emulated = _logits(net, PROMPTS)
    net.set_backend(CPUBackend(config))
    ours = _logits(net, PROMPTS)
    assert_rel_close(ours, emulated, 1e-4, "int8 CPU backend vs emulated kernels")
    assert_rel_close(ours, ref, 0.1, "int8 CPU backend vs dequantized weights")


def test_untied_lm_head_is_quantized_too(tmp_path):
    cfg = tiny_text_config(vocab_size=131, tie_word_embeddings=False)
    path = write_random_checkpoint(tmp_path, cfg, seed=6, dtype=torch.bfloat16)
    net, config, _ = load_model(path, torch.float32, quantization="int8")
    assert net.lm_head.weight is None and isinstance(net.lm_head.qweight, quant.QuantWeight)
    net.set_backend(ReferenceBackend(config))
    assert torch.equal(_logits(net, PROMPTS), _logits(_dequantized_model(path), PROMPTS))


def test_every_weight_is_int8_and_memory_is_about_half(ckpt):
    net, _, _ = load_model(ckpt, torch.bfloat16, quantization="int8", with_mtp=True)
    full, _, _ = load_model(ckpt, torch.bfloat16, with_mtp=True)
    assert net.mtp is not None
    names = quant.quantized_names(full)
    assert {n for n, _ in net.named_parameters()}.isdisjoint(names)
    assert isinstance(net.model.embed_tokens, quant.QuantEmbedding)
    linears = [m for m in net.modules() if hasattr(m, "qweight")]
    assert len(linears) == len(names)
    assert all(isinstance(m.qweight, quant.QuantWeight) for m in linears)
    bf16 = sum(p.numel() * 2 for n, p in full.named_parameters() if n in names)
    int8 = sum(m.qweight.nbytes for m in linears)
    # 34 bytes per 32 weights against 64, plus this tiny model's padding to 16 x 32 blocks
    assert 0.5 < int8 / bf16 < 0.75, int8 / bf16
    assert net.dtype == torch.bfloat16


def test_speculative_decoding_is_lossless_with_int8():
    """Greedy with MTP drafts (k = 1..3) reproduces the int8 model's own k=0 tokens exactly.
    The demo model's trained MTP head gets drafts accepted, so verification runs 2-4 rows."""
    llm = LLM(quantization="int8", speculative_tokens=3, max_model_len=256, max_num_seqs=4,
              cache_memory=64 << 20)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What does json.dumps do?", "What is a hash table?",
                         "How does binary search work?")]
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False,
                                                          speculative_tokens=0)]
    for k in (1, 3):
        outs = llm.generate(prompts, sp, use_tqdm=False, speculative_tokens=k)
        assert [o.outputs[0].token_ids for o in outs] == base, k
        assert sum(o.metrics["spec"]["num_accepted"] for o in outs) > 0


def test_unknown_quantization_is_one_clear_error(ckpt):
    with pytest.raises(ValueError, match="unknown quantization 'int3'; choose int8 or int4"):
        LLM(ckpt, quantization="int3")
    with pytest.raises(ValueError, match="CPU backends only"):
        LLM(ckpt, quantization="int8", backend="triton")


@pytest.mark.parametrize("command", [["chat"], ["generate", "-p", "hi"], ["bench", "throughput"],
                                     ["bench", "spec"]], ids=lambda c: "-".join(c))
def test_cli_unknown_quantization_is_one_error_line_exit_2(command):
    res = CliRunner().invoke(app, [*command, "--quantization", "int3"], input="hi\n")
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert lines == ["error: --quantization: unknown quantization 'int3'; choose int8 or int4 "
                     "(or none)"], res.stderr


def test_cli_generate_with_int8():
    res = CliRunner().invoke(app, ["generate", "-p", "What does json.dumps do?", "--chat",
                                   "--quantization", "int8", "--temperature", "0",
                                   "--max-tokens", "4", "--no-progress"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["token_ids"]) == 4


# Stored int8 checkpoints (hybridrt quantize) ------------------------------------------------
@pytest.fixture(scope="module")
def saved(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved") / "int8"
    info = save_quantized(ckpt, out)
    assert info["path"] == str(out) and (out / "model.safetensors").stat().st_size == info["bytes"]
    return out


def test_saved_int8_checkpoint_holds_the_load_time_quantization(ckpt, saved):
    """Every int8 weight (MTP, tied embedding included) and every other tensor as loading the
    source with quantization="int8" gives them, whatever quantization is asked; the config
    comes along."""
    fresh, _, _ = load_model(ckpt, torch.bfloat16, quantization="int8", with_mtp=True)
    stored, _, _ = load_model(saved, torch.bfloat16, with_mtp=True)
    assert stored.mtp is not None
    q_fresh = {n: m.qweight for n, m in fresh.named_modules()
               if isinstance(getattr(m, "qweight", None), quant.QuantWeight)}
    q_stored = {n: m.qweight for n, m in stored.named_modules()
                if isinstance(getattr(m, "qweight", None), quant.QuantWeight)}
    assert q_fresh.keys() == q_stored.keys() and "model.embed_tokens" in q_stored
    for n, qw in q_fresh.items():
        assert q_stored[n].shape == qw.shape, n
        assert torch.equal(q_stored[n].qs, qw.qs) and torch.equal(q_stored[n].scales, qw.scales), n
    sd_fresh, sd_stored = fresh.state_dict(), stored.state_dict()
    assert sd_fresh.keys() == sd_stored.keys()
    assert all(torch.equal(sd_fresh[k], sd_stored[k]) for k in sd_fresh)
    assert (saved / "config.json").read_text() == (ckpt / "config.json").read_text()


def test_saved_int8_checkpoint_generates_what_load_time_int8_does(ckpt, saved):
    prompts = [{"prompt_token_ids": [5, 9, 2, 77, 31]}, {"prompt_token_ids": [40, 41, 3]}]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for llm in (LLM(ckpt, quantization="int8", cache_memory=16 << 20),
                LLM(saved, cache_memory=16 << 20)):
        assert llm.quantization == "int8"
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_saved_int8_checkpoint_errors(ckpt, saved, tmp_path):
    from safetensors.torch import load_file, save_file

    from hybridrt.loader import QUANT_METADATA, CheckpointError

    with pytest.raises(CheckpointError, match="run on the CPU only"):
        load_model(saved, device="cuda")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        save_quantized(ckpt, saved)
    tensors = load_file(str(saved / "model.safetensors"))
    meta = {"format": "pt", QUANT_METADATA: "int8"}
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((saved / "config.json").read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    cases = [
        ({k: v for k, v in tensors.items() if k != f"{name}.qs"}, meta,
         rf"missing tensor: {name}\.qs"),
        ({**tensors, f"{name}.scales": tensors[f"{name}.scales"].float()}, meta,
         r"\(qs, scales\) must be torch.int8, torch.float16, found torch.int8, torch.float32"),
        ({**tensors, f"{name}.qs": tensors[f"{name}.qs"][:1]}, meta, rf"{name}\.qs: expected"),
        (tensors, {"format": "pt", QUANT_METADATA: "int3"}, "unknown hybridrt.quantization"),
    ]
    for t, md, match in cases:
        save_file(t, str(bad / "model.safetensors"), metadata=md)
        with pytest.raises(CheckpointError, match=match):
            load_model(bad)


def test_cli_quantize(ckpt, tmp_path):
    out = tmp_path / "q"
    res = CliRunner().invoke(app, ["quantize", str(ckpt), str(out)])
    assert res.exit_code == 0, res.output
    assert res.stderr.startswith(f"wrote {out}: ")
    res = CliRunner().invoke(app, ["quantize", str(ckpt), str(out)])
    assert res.exit_code == 2
    assert res.stderr.strip() == f"error: {out} exists and is not an empty directory"
    res = CliRunner().invoke(app, ["quantize", str(tmp_path / "nowhere"), str(tmp_path / "x")])
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith("error: ") and not (tmp_path / "x").exists()
