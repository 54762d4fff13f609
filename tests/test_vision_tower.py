"""The vision tower's parts against transformers (the encoder, M-RoPE positions), loading
(``language_model_only``, a tower that does not fit its config) and the refusals of a model
that has a tower: placeholders that do not pair with the images or videos, undecodable
bytes."""

from __future__ import annotations

import json
import re

import numpy as np
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
from hybridrt.loader import CheckpointError
from hybridrt.vision.config import VisionConfig
from hybridrt.vision.encoder import VisionEncoder
from hybridrt.vision.positions import mrope_positions

GREEDY = SamplingParams(temperature=0, max_tokens=3)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("tower"), seed=5)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB")


def test_encoder_matches_transformers_on_images_and_frames(ckpt):
    """Grids of several shapes at once (per-image attention), one of two frames."""
    ref = ckpt[1].model.visual
    cfg = VisionConfig(**VISION, out_hidden_size=ref.merger.linear_fc2.out_features)
    ours = VisionEncoder(cfg)
    ours.load_state_dict(ref.state_dict())
    grids = [(1, 6, 4), (1, 4, 10), (2, 2, 2), (1, 16, 16)]
    n = sum(t * h * w for t, h, w in grids)
    px = torch.randn(n, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(px, grid_thw=torch.tensor(grids)).pooler_output
        got = ours(px, grids)
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_mrope_positions_match_get_rope_index(ckpt):
    ref = ckpt[1].model
    image_id = ref.config.image_token_id
    # text, an image of merged grid 3x2, text, an image 2x5, text
    grids = [(1, 6, 4), (1, 4, 10)]
    ids = [5] * 4 + [image_id] * 6 + [7] * 3 + [image_id] * 10 + [9] * 2
    want, delta = ref.get_rope_index(torch.tensor([ids]), torch.tensor([[int(t == image_id)
                                                                          for t in ids]]),
                                     image_grid_thw=torch.tensor(grids))
    got, d = mrope_positions(len(ids), [(4, (1, 3, 2)), (13, (1, 2, 5))])
    assert np.array_equal(got, want[:, 0].numpy())
    assert d == int(delta) == int(got.max()) + 1 - len(ids)


def test_language_model_only_skips_the_tower_and_refuses_images(ckpt, llm):
    text_only = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
                    language_model_only=True)
    assert text_only.vision is None and llm.vision is not None
    outs = text_only.generate(["hello", {"prompt": f"{IMG}hi", "multi_modal_data": {
        "image": [image(8, 8, 0)]}}], GREEDY, use_tqdm=False)
    assert str(outs[1].error) == ("multi_modal_data (image) refused: the vision tower was not "
                                  "loaded (language_model_only)")
    (same,) = llm.generate(["hello"], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == same.outputs[0].token_ids


@pytest.mark.parametrize("prompt, data, words", [
    (f"{IMG}{IMG}two?", {"image": [image(8, 8, 0)]}, "2 image placeholder(s)"),
    ("none here", {"image": [image(8, 8, 0)]}, "0 image placeholder(s)"),
    (f"{IMG}?", {"image": [b"not an image"]}, "cannot be decoded as an image"),
    (f"{IMG}?", {"image": ["/no/such/file.png"]}, "does not exist"),
    (f"{IMG}?", {"image": [image(8, 8, 0)], "video": [[image(8, 8, 0)] * 2]},
     "0 video placeholder(s)"),
    ("<|vision_start|><|video_pad|><|vision_end|>?", {"image": []}, "1 video placeholder(s)"),
    (f"{IMG}?", None, "1 image/video placeholder token(s) but no images or videos were given"),
    (f"{IMG}?", {}, "1 image/video placeholder token(s) but no images or videos were given"),
])
def test_bad_image_input_fails_its_own_request(llm, prompt, data, words):
    p = {"prompt": prompt} if data is None else {"prompt": prompt, "multi_modal_data": data}
    outs = llm.generate([p, "fine"], GREEDY, use_tqdm=False)
    assert outs[0].error is not None and words in str(outs[0].error), outs[0].error
    assert outs[1].error is None


LIMIT_ERROR = ("the prompt holds 2 image(s), over the limit of 1 per prompt "
               "(limit_mm_per_prompt / --limit-mm-per-prompt)")


def test_more_images_than_the_per_prompt_limit_fail_their_own_request(ckpt, llm):
    """limit_mm_per_prompt (vLLM's): a prompt with more images fails alone, in generate and
    chat, before its images are read; prompts within the limit answer as without one."""
    limited = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
                  limit_mm_per_prompt={"image": 1})
    assert limited.vision.max_images == 1 and llm.vision.max_images is None
    a, b = image(24, 32, 1), image(16, 16, 2)
    one = {"prompt": f"{IMG}one?", "multi_modal_data": {"image": [a]}}
    outs = limited.generate([{"prompt": f"{IMG}{IMG}two?", "multi_modal_data": {
        "image": [a, object()]}}, one], GREEDY, use_tqdm=False)  # the 2nd is never read
    assert str(outs[0].error) == LIMIT_ERROR and outs[0].outputs[0].finish_reason == "error"
    (want,) = llm.generate([one], GREEDY, use_tqdm=False)
    assert outs[1].error is None and outs[1].outputs[0].token_ids == want.outputs[0].token_ids
    two_turns = [{"role": "user", "content": [{"type": "image", "image": a}]},
                 {"role": "assistant", "content": "ok"},
                 {"role": "user", "content": [{"type": "image", "image": b},
                                              {"type": "text", "text": "and?"}]}]
    outs = limited.chat([two_turns, two_turns[2:]], GREEDY, use_tqdm=False)
    assert str(outs[0].error) == LIMIT_ERROR and outs[1].error is None
    none = LLM(ckpt[0], dtype="float32", max_model_len=256, cache_memory="32MiB",
               limit_mm_per_prompt='{"image": 0}')  # the CLI's JSON text
    (out,) = none.generate([one], GREEDY, use_tqdm=False)
    assert "holds 1 image(s), over the limit of 0 per prompt" in str(out.error)


@pytest.mark.parametrize("value", ['{"image": -1}', "{", {"images": 2}, {"image": True},
                                   ["image", 2]])
def test_a_bad_per_prompt_limit_is_one_error_before_loading(value):
    from hybridrt.engine_args import EngineArgs

    with pytest.raises(ValueError, match="limit_mm_per_prompt") as e:
        EngineArgs(limit_mm_per_prompt=value)
    assert "\n" not in str(e.value)
    assert EngineArgs(limit_mm_per_prompt='{"image": 3, "video": 0}').image_limit == 3
    assert EngineArgs().image_limit is None


def test_chat_with_a_video_part_of_a_missing_frame_fails_alone(llm):
    conv = [{"role": "user", "content": [{"type": "video", "video": ["a.png", "b.png"]},
                                         {"type": "text", "text": "?"}]}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert str(out.error) == "image file 'a.png' does not exist"


def test_a_tower_that_does_not_fit_its_config_fails_to_load(ckpt, tmp_path):
    import shutil

    for f in ckpt[0].iterdir():
        shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["vision_config"]["depth"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"missing \['model.visual.blocks.2"):
        LLM(tmp_path, dtype="float32", max_model_len=64, cache_memory="16MiB")


def test_cli_chat_shows_images_from_the_flag_a_command_and_a_pasted_path(ckpt, llm, tmp_path):
    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    img = tmp_path / "cat.png"
    image(40, 24, 11).save(img)
    conv = [{"role": "user", "content": [{"type": "image", "image": str(img)},
                                         {"type": "text", "text": "What is it?"}]}]
    (want,) = llm.chat(conv, GREEDY, use_tqdm=False)
    flags = ["--dtype", "float32", "--max-model-len", "256", "--cache-memory", "32MiB",
             "--temperature", "0", "--max-tokens", "3"]
    outs = []
    for how, script in [(["--image", str(img)], "What is it?\n/stats\nAnd now?\n/stats\n"),
                        ([], f"/image {img}\nWhat is it?\n"),
                        ([], f"'{img}'\nWhat is it?\n")]:
        res = CliRunner().invoke(app, ["chat", str(ckpt[0]), *flags, *how], input=script)
        assert res.exit_code == 0, res.output
        assert want.outputs[0].text + "\n[prompt" in res.stdout, res.stdout
        assert "shown with the next message" in res.stdout
        outs.append(res.stdout)
    # the second turn resumes after the first turn's image and answer
    reused = [int(v) for v in re.findall(r"reused tokens\s+(\d+)", outs[0])]
    assert len(reused) == 2 and reused[1] >= len(want.prompt_token_ids) - 1, outs[0]
    res = CliRunner().invoke(app, ["chat", str(ckpt[0]), *flags],
                             input="/image /no/such.png\nhi\n")
    assert res.exit_code == 0 and "error: /image: image file '/no/such.png' does not exist" \
        in res.stderr
    res = CliRunner().invoke(app, ["chat", str(ckpt[0]), *flags, "--image", "/no/such.png"])
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: --image: image file '/no/such.png' does not exist"


def test_generate_jsonl_messages_with_image_parts_answer_as_llm_chat(ckpt, llm, tmp_path):
    """``hybridrt generate`` lines with image parts (a data URL, a path, two images) answer
    what LLM.chat answers; a one-frame video, a missing file and more images than
    --limit-mm-per-prompt fail their own line."""
    import base64
    import io

    from typer.testing import CliRunner

    from hybridrt.cli.main import app

    img, other = tmp_path / "cat.png", image(24, 32, 13)
    image(40, 24, 11).save(img)
    buf = io.BytesIO()
    other.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    convs = [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": "What is it?"}]}],
        [{"role": "user", "content": [{"type": "image", "image": str(img)},
                                      {"type": "text", "text": "And this?"}]}],
        [{"role": "user", "content": [{"type": "image", "image": str(img)}]},
         {"role": "assistant", "content": "a cat"},
         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                      {"type": "text", "text": "and?"}]}],
    ]
    wants = llm.chat(convs, GREEDY, use_tqdm=False)
    bad = [[{"role": "user", "content": [{"type": "video", "video": [str(img)]}]}],
           [{"role": "user", "content": [{"type": "image", "image": "/no/such.png"}]}]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs + bad))
    flags = ["--dtype", "float32", "--max-model-len", "256", "--cache-memory", "32MiB",
             "--temperature", "0", "--max-tokens", "3", "--no-progress"]
    runs = {}
    for name, extra in (("open", []), ("limited", ["--limit-mm-per-prompt", '{"image": 1}'])):
        res = CliRunner().invoke(app, ["generate", str(ckpt[0]), *flags, *extra, "-i",
                                       str(src)])
        assert res.exit_code == 1, res.output  # the bad lines failed
        runs[name] = [json.loads(ln) for ln in res.stdout.splitlines()]
    recs = runs["open"]
    assert [r["id"] for r in recs] == [0, 1, 2, 3, 4]
    for rec, want in zip(recs, wants):
        assert "error" not in rec, rec
        assert rec["token_ids"] == want.outputs[0].token_ids
        assert rec["metrics"]["vision"]["num_images"] == len(vision_parts(rec["prompt"]))
    assert recs[3]["error"] == ("line 4: the video has 1 frame(s): a video needs at least 2 "
                                "(give a single frame as an image)")
    assert recs[4]["error"] == "line 5: image file '/no/such.png' does not exist"
    limited = runs["limited"]
    assert [r["token_ids"] for r in limited[:2]] == [r["token_ids"] for r in recs[:2]]
    assert limited[2]["error"] == ("line 3: the prompt holds 2 image(s), over the limit of 1 "
                                   "per prompt (limit_mm_per_prompt / --limit-mm-per-prompt)")


def vision_parts(prompt: str) -> list[str]:
    return re.findall(r"<\|vision_start\|>", prompt)


def test_encoder_at_the_08b_vision_widths_in_bf16_is_within_bf16_of_transformers():
    """The 0.8B's vision widths (hidden 768, 12 heads, MLP 3072, patch 16, out 1024, a 48x48
    position grid; two blocks, not twelve, to keep it short), random bf16 weights, a 448x448
    image: the merged embeddings within bf16 rounding of transformers' in bf16, and as close
    to the fp32 result as transformers' own bf16 run is."""
    got, want, exact = bf16_tower_runs(0, lambda ours: ours.to(torch.bfloat16))
    assert max_rel_err(got, want) < 2e-2
    assert max_rel_err(got, exact) < 2 * max_rel_err(want, exact) + 1e-3


def test_a_decompression_bomb_is_refused(llm, monkeypatch):
    import io

    from PIL import Image

    buf = io.BytesIO()
    image(64, 64, 0).save(buf, format="PNG")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 4096 pixels are over it
    outs = llm.generate([{"prompt": f"{IMG}?", "multi_modal_data": {"image": [buf.getvalue()]}}],
                        GREEDY, use_tqdm=False)
    assert "refused, too many pixels" in str(outs[0].error)


def test_encoder_bench_runs(capsys):
    from hybridrt.bench import vision

    tiny = json.dumps({**VISION, "out_hidden_size": 16})
    vision.main(["--sizes", "40x24,64x64", "--dtype", "float32", "--config", tiny])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["grid"] for r in rows] == [[1, 10, 6], [1, 16, 16]]
    assert [r["tokens"] for r in rows] == [15, 64] and all(r["seconds"] > 0 for r in rows)
