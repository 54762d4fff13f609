"""Incremental detokenization: the streamed text equals a one-shot decode, multi-byte
characters split over byte tokens are held back until complete, and stop strings that straddle
tokens cut the text where a one-shot decode would."""

from __future__ import annotations

import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.detokenizer import IncrementalDetokenizer
from hybridrt.sampler import SamplerOutput

# accents, CJK, emoji with a skin-tone modifier, a currency sign: the demo tokenizer (byte-level
# BPE trained on English) splits most of these characters over two to four byte tokens
TEXT = "naïve café, 日本語のテキスト 🙂👍🏽 costs €5 — ok.\nÜber straße ½ → ∞ 한국어!"


@pytest.fixture(scope="module")
def demo_llm():
    return LLM(dtype="float32", max_model_len=256, max_num_seqs=2, cache_memory=32 << 20)


def _stream(tok, ids, skip=True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    pieces = [detok.add(t) for t in ids[:-1]] + [detok.add(ids[-1], final=True)]
    assert detok.text == "".join(pieces)
    return pieces


def test_pieces_concatenate_to_a_one_shot_decode(demo_llm):
    tok = demo_llm.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert sum("\ufffd" in tok.decode([t]) for t in ids) > 10  # characters split over tokens
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == TEXT
    assert not any("\ufffd" in p for p in pieces)  # held back until complete
    assert sum(p == "" for p in pieces) > 5


def test_special_tokens_and_random_byte_sequences(demo_llm):
    """Skipped and kept special tokens, and random ids (invalid UTF-8 included): the pieces
    still add up to the one-shot decode, replacement characters and all."""
    tok = demo_llm.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("a b", add_special_tokens=False) + [eos]
    ids += tok.encode(" ü", add_special_tokens=False)
    for skip in (True, False):
        assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ids = torch.randint(0, tok.vocab_size, (40,), generator=g).tolist()
        assert "".join(_stream(tok, ids)) == tok.decode(ids, skip_special_tokens=True)


def test_flush_ends_a_stream_without_the_last_token(demo_llm):
    tok = demo_llm.tokenizer
    ids = tok.encode("x🙂", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(t) for t in ids[:-1]] == ["x"] + [""] * (len(ids) - 2)
    assert detok.flush() == tok.decode(ids[1:-1])  # a cut character, as it decodes


def _script(llm, monkeypatch, ids: list[int]) -> None:
    """Make the engine 'sample' ``ids`` in order (the model still runs)."""

    def sample(logits, rows):
        toks = [ids[min(len(r.output_token_ids), len(ids) - 1)] for r in rows]
        return SamplerOutput(token_ids=torch.tensor(toks, device=logits.device))

    monkeypatch.setattr(llm.engine.sampler, "sample", sample)


def test_engine_streams_multi_byte_text_exactly(demo_llm, monkeypatch):
    tok = demo_llm.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    _script(demo_llm, monkeypatch, ids)
    sp = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True)
    deltas = list(demo_llm.stream("Q", sp))
    assert "".join(deltas) == demo_llm.last_stream_output.outputs[0].text == TEXT
    assert not any("\ufffd" in d for d in deltas)
    (out,) = demo_llm.generate("Q", sp, use_tqdm=False)
    assert out.outputs[0].token_ids == ids and out.outputs[0].text == TEXT


@pytest.mark.parametrize("stop", ["é, 日", "テキ", "🙂👍", "€5 —", "\nÜb"])
def test_stop_strings_that_straddle_tokens(demo_llm, monkeypatch, stop):
    tok = demo_llm.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    at, end = TEXT.index(stop), TEXT.index(stop) + len(stop)
    # where the text between tokens is complete: the stop string crosses one of those points
    # or ends inside a character's bytes
    bounds = {len(t) for t in (tok.decode(ids[:i]) for i in range(len(ids) + 1))
              if not t.endswith("\ufffd")}
    assert any(at < b < end for b in bounds) or end not in bounds
    _script(demo_llm, monkeypatch, ids)
    sp = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True, stop=[stop])
    (out,) = demo_llm.generate("Q", sp, use_tqdm=False)
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (TEXT[:at], "stop", stop)
    # generation stopped at the token that completed the stop string
    n = next(i for i in range(len(ids) + 1) if stop in tok.decode(ids[:i]))
    assert c.token_ids == ids[:n]
    assert "".join(demo_llm.stream("Q", sp)) == TEXT[:at]
    (kept,) = demo_llm.generate("Q", sp.clone(include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == TEXT[:at + len(stop)]


def test_each_token_decodes_a_short_window(demo_llm, monkeypatch):
    """Linear, not quadratic: over a 200-token output the engine decodes a few tokens per new
    token (re-decoding the whole output each time would be ~20000 token decodes)."""
    tok = demo_llm.tokenizer
    ids = (tok.encode(TEXT, add_special_tokens=False) * 8)[:200]
    _script(demo_llm, monkeypatch, ids)
    decoded = []
    decode = type(tok).decode
    monkeypatch.setattr(type(tok), "decode",
                        lambda self, t, **kw: decoded.append(len(t)) or decode(self, t, **kw))
    sp = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True)
    (out,) = demo_llm.generate("Q", sp, use_tqdm=False)
    work = sum(decoded)
    assert out.outputs[0].token_ids == ids and out.outputs[0].text == decode(tok, ids)
    assert work < 10 * len(ids) and max(decoded) < 16, (work, max(decoded))
