"""hybridrt/tokenizer.py against transformers' PreTrainedTokenizerFast on the same files: the
same ids, the same text, the same rendered chats; and the first token without transformers."""

import json
import random
import subprocess
import sys

import pytest

from hybridrt.llm import default_model
from hybridrt.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "hi", "Hello, world!", "  leading spaces and trailing  ", "line one\nline two\n\n\tTab",
    "ünïcödé 漢字 and emoji 🦙🚀", "<|im_start|>user\nhi<|im_end|>", "<think>\nx\n</think>",
    "don't can't it's we've they're", "a , b . c ? d !", "1234567890 3.14159 -42", "",
]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
    [{"role": "user", "content": "weather?"},
     {"role": "assistant", "content": "", "reasoning_content": "use the tool",
      "tool_calls": [{"type": "function", "function": {
          "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
     {"role": "tool", "content": "sunny"}, {"role": "tool", "content": "warm"},
     {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "q"},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nanswer", "tool_calls": None}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "t"}],
]


@pytest.fixture(scope="module")
def pair():
    from transformers import PreTrainedTokenizerFast

    path = default_model()
    return Tokenizer(path), PreTrainedTokenizerFast.from_pretrained(path)


@pytest.mark.parametrize("special", [False, True])
def test_encode_matches_transformers(pair, special):
    ours, theirs = pair
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=special) == theirs.encode(
            text, add_special_tokens=special), text


@pytest.mark.parametrize("skip", [False, True])
def test_decode_matches_transformers(pair, skip):
    ours, theirs = pair
    rng = random.Random(0)
    n = len(theirs)
    specials = sorted(theirs.all_special_ids) + [theirs.convert_tokens_to_ids("<think>")]
    for _ in range(200):
        ids = [rng.randrange(n) if rng.random() < 0.85 else rng.choice(specials)
               for _ in range(rng.randrange(1, 12))]
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip), ids
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)
        for clean in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip,
                               clean_up_tokenization_spaces=clean) == theirs.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=clean), (text, clean)


def test_special_tokens_and_lookups_match(pair):
    ours, theirs = pair
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    for name in ("eos_token", "pad_token", "bos_token", "unk_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
        assert getattr(ours, name + "_id") == getattr(theirs, name + "_id"), name
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "hello", "not-a-token-xyz"):
        assert ours.convert_tokens_to_ids(token) == theirs.convert_tokens_to_ids(token), token


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen,kwargs", [(True, {}), (True, {"enable_thinking": True}),
                                        (False, {"enable_thinking": False})])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_matches_transformers(pair, chat, gen, kwargs, tools):
    ours, theirs = pair
    msgs = CHATS[chat]
    want = theirs.apply_chat_template(msgs, tools=tools, tokenize=False,
                                      add_generation_prompt=gen, **kwargs)
    got = ours.apply_chat_template(msgs, tools=tools, tokenize=False,
                                   add_generation_prompt=gen, **kwargs)
    assert got == want
    assert ours.apply_chat_template(msgs, tools=tools, add_generation_prompt=gen, **kwargs) \
        == ours.encode(want, add_special_tokens=False)


def test_chat_template_errors(pair, tmp_path):
    ours, _ = pair
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([], tokenize=False)
    for f in ("tokenizer.json",):
        (tmp_path / f).write_bytes((ours.path / f).read_bytes())
    bare = Tokenizer(tmp_path)
    with pytest.raises(ValueError, match="has no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert bare.eos_token is None and bare.eos_token_id is None


def test_chat_template_file_takes_precedence(pair, tmp_path):
    ours, _ = pair
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((ours.path / f).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ eos_token }}")
    tok = load_tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) \
        == "[user]x<|im_end|>"


def test_load_tokenizer_without_files_is_none(tmp_path):
    assert load_tokenizer(tmp_path) is None


def test_first_token_does_not_import_transformers(tmp_path):
    """The path to the first token (load the demo model, chat, generate) imports no
    transformers: its import alone costs more than the rest of start-up."""
    code = (
        "import sys\n"
        "from hybridrt import LLM, SamplingParams\n"
        "llm = LLM(threads=1, max_model_len=256, max_num_seqs=2)\n"
        "out = llm.chat([{'role': 'user', 'content': 'hi'}], "
        "SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "out = llm.generate(['hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1].replace("'", '"')) == []
