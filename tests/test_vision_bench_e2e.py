"""The end-to-end image bench (hybridrt.bench.vision_e2e) at a tiny shape: its report's
fields, an image encoded in every image run, and prompts of the lengths it claims."""

from __future__ import annotations

import json

from vision_helpers import VISION, text_config


def test_end_to_end_bench_reports_each_run(tmp_path, capsys):
    from hybridrt.bench import vision_e2e

    out = tmp_path / "report.json"
    vision = json.dumps({**VISION, "out_hidden_size": 48})
    text = json.dumps(text_config(hidden_size=48))
    vision_e2e.main(["--sizes", "64x64,64x96", "--config", vision, "--text-config", text,
                     "--threads", "1", "--repeat", "2", "--warmup", "0", "--decode", "4",
                     "--question", "6", "--dtype", "float32", "--json", str(out)])
    report = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "decode image / text" in printed and "load average" in printed
    assert report["repeat"] == 2 and report["decode_tokens"] == 4
    assert [r["size"] for r in report["rows"]] == ["64x64", "64x96"]
    for row, tokens in zip(report["rows"], (64, 96)):  # patch 4, merge 2: 8x8 pixels a token
        image, text_run, question = row["image"], row["text"], row["question"]
        assert image["encoder_runs"] == [1, 1]  # no prefix-cache hit on the repeat
        assert image["image_tokens"] == tokens
        assert image["prompt_tokens"] == text_run["prompt_tokens"] == tokens + 2 + 6
        assert question["prompt_tokens"] == 6
        for run in (image, text_run, question):  # every run prefills its whole prompt
            assert run["cached_tokens"] == [0, 0]
        for fig in ("ttft", "engine_ttft", "preprocess_s", "encoder_s", "prefill_s"):
            assert 0 < image[fig]["best"] <= image[fig]["median"]  # times: the least is best
        assert image["decode_tok_s"]["best"] >= image["decode_tok_s"]["median"] > 0
        assert image["encoder_s"]["best"] < image["engine_ttft"]["median"]
        assert "encoder_s" not in text_run and text_run["decode_tok_s"]["best"] > 0
        assert row["decode_ratio"]["median"] > 0 and row["decode_ratio"]["best_over_best"] > 0
