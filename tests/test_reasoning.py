"""The think block apart from the answer: finished outputs, streams, and the LLM API."""

import pytest

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_char_tokenizer, write_random_checkpoint
from hybridrt.reasoning import ReasoningDelta, ReasoningSplitter, split_reasoning

CASES = [
    # (output text, prompt leaves <think> open) -> (reasoning_text, text)
    (("<think>\nlet me see\n</think>\n\nParis.", False), ("let me see", "Paris.")),
    (("  <think>a b</think>c", False), ("a b", "c")),
    (("hmm, so\n</think>\n\nParis.\n", True), ("hmm, so", "Paris.\n")),
    (("</think>\n\nParis.", True), ("", "Paris.")),
    (("still thinking when cut", True), ("still thinking when cut", "")),
    (("<think>\n\n</think>\n\n", False), ("", "")),
    (("\nParis. <think>x</think>", False), (None, "\nParis. <think>x</think>")),
    (("<thinking is not a tag", False), (None, "<thinking is not a tag")),
    (("", False), (None, "")),
    (("a</think>b</think>c", True), ("a", "b</think>c")),  # only the first block
]


@pytest.mark.parametrize("args, expected", CASES, ids=[repr(c[0][0])[:24] for c in CASES])
def test_split_reasoning(args, expected):
    assert split_reasoning(*args) == expected


@pytest.mark.parametrize("args, expected", CASES, ids=[repr(c[0][0])[:24] for c in CASES])
def test_streamed_pieces_join_to_the_split_at_any_cut(args, expected):
    text, opened = args
    for i in range(len(text) + 1):
        deltas = [text[:i], text[i:]]
        s = ReasoningSplitter(opened)
        pieces = [p for d in deltas for p in s.feed(d)] + s.flush()
        assert all(p for p in pieces)
        reasoning = "".join(p for p in pieces if isinstance(p, ReasoningDelta))
        answer = "".join(p for p in pieces if not isinstance(p, ReasoningDelta))
        assert ((reasoning if s.thinks else None), answer) == expected
    s = ReasoningSplitter(opened)  # one character at a time
    pieces = [p for ch in text for p in s.feed(ch)] + s.flush()
    assert "".join(p for p in pieces if not isinstance(p, ReasoningDelta)) == expected[1]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("think"), tiny_text_config(), seed=3)
    write_char_tokenizer(d)
    return LLM(d, dtype="float32", max_model_len=128, cache_memory=8 << 20)


def test_generate_and_stream_carry_the_think_block_apart(llm):
    """A prompt that leaves <think> open: the output is reasoning up to </think>."""
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt, opened in (("Q? <think>\n", True), ("Q? <think></think>", False)):
        (out,) = llm.generate(prompt, sp, use_tqdm=False)
        c = out.outputs[0]
        raw = llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert (c.reasoning_text, c.text) == split_reasoning(raw, opened)
        assert (c.reasoning_text is not None) == opened
        deltas = list(llm.stream(prompt, sp))
        assert "".join(d for d in deltas if not isinstance(d, ReasoningDelta)) == c.text
        if opened:
            assert "".join(d for d in deltas if isinstance(d, ReasoningDelta)) == \
                c.reasoning_text
        assert llm.last_stream_output.outputs[0].reasoning_text == c.reasoning_text
        (chat,) = llm.chat([{"role": "user", "content": "Q?"}], sp, use_tqdm=False)
        assert chat.outputs[0].reasoning_text is None  # this template does not open <think>
