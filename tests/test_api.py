"""The public API with text: tokenizer round trip, stop strings, streaming, chat."""

import pytest
import torch

from hybridrt import LLM, SamplingParams
from hybridrt.bench.fixtures import tiny_text_config, write_char_tokenizer, write_random_checkpoint
from hybridrt.engine_args import default_batched_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = write_random_checkpoint(tmp_path_factory.mktemp("tiny-tok"), tiny_text_config(), seed=5)
    write_char_tokenizer(d)
    return LLM(d, dtype="float32", max_model_len=256, max_num_seqs=4, cache_memory=16 << 20)


def test_text_prompt_is_tokenized_and_output_detokenized(llm):
    (out,) = llm.generate("Hello, world", GREEDY, use_tqdm=False)
    assert out.prompt == "Hello, world"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello, world", add_special_tokens=False)
    c = out.outputs[0]
    assert len(c.token_ids) == 24
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def _stop_candidate(text: str) -> tuple[str, int]:
    for i in range(3, len(text) - 2):
        s = text[i:i + 2]
        if text.find(s) == i and s.strip():
            return s, i
    pytest.skip("no usable stop string in this output")


def test_stop_string_cuts_text(llm):
    (free,) = llm.generate("The quick brown fox", GREEDY, use_tqdm=False)
    stop, at = _stop_candidate(free.outputs[0].text)
    sp = GREEDY.clone(stop=[stop, "never-appears"])
    (cut,) = llm.generate("The quick brown fox", sp, use_tqdm=False)
    c = cut.outputs[0]
    assert c.text == free.outputs[0].text[:at]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert len(c.token_ids) < len(free.outputs[0].token_ids)
    (kept,) = llm.generate("The quick brown fox", sp.clone(include_stop_str_in_output=True),
                           use_tqdm=False)
    assert kept.outputs[0].text == free.outputs[0].text[:at + len(stop)]


def test_stream_deltas_concatenate_to_the_generated_text(llm):
    (full,) = llm.generate("streaming", GREEDY, use_tqdm=False)
    deltas = list(llm.stream("streaming", GREEDY))
    assert len(deltas) > 1
    assert "".join(deltas) == full.outputs[0].text
    assert llm.engine.cache.all_free()


def test_stream_abandoned_midway_frees_its_request(llm):
    it = llm.stream("abandon", GREEDY)
    next(it)
    it.close()
    assert llm.engine.cache.all_free()
    assert not llm.engine.has_unfinished_requests()


def test_chat_applies_the_template(llm):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    (out,) = llm.chat(msgs, GREEDY, use_tqdm=False,
                      chat_template_kwargs={"enable_thinking": False})
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
               "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert out.prompt == expected
    assert out.prompt_token_ids == llm.tokenizer.encode(expected, add_special_tokens=False)
    outs = llm.chat([msgs, msgs[1:]], GREEDY, use_tqdm=False)
    assert len(outs) == 2 and outs[1].prompt.startswith("<|im_start|>user")


def test_batch_mixes_text_and_token_prompts_in_order(llm):
    ids = llm.tokenizer.encode("abc", add_special_tokens=False)
    outs = llm.generate(["abc", ids, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids \
        == outs[2].outputs[0].token_ids


def test_empty_text_prompt_is_rejected_alone(llm):
    outs = llm.generate(["", "ok"], GREEDY, use_tqdm=False)
    assert isinstance(outs[0].error, ValueError) and "empty" in str(outs[0].error)
    assert outs[1].error is None and len(outs[1].outputs[0].token_ids) == 24


def test_progress_bar_writes_to_stderr(llm, capsys):
    llm.generate(["a", "b"], GREEDY.clone(max_tokens=2), use_tqdm=True)
    assert "generate" in capsys.readouterr().err


def test_generate_iter_yields_requests_as_they_finish_and_close_aborts(llm):
    params = [GREEDY.clone(max_tokens=n) for n in (20, 2, 5, 8)]
    order = [i for i, _ in llm.generate_iter(["x", "y", "", "z"], params, use_tqdm=False)]
    assert order == [2, 1, 3, 0]  # the rejected empty prompt first, then by length
    it = llm.generate_iter(["x", "y"], [GREEDY.clone(max_tokens=2), GREEDY], use_tqdm=False)
    assert next(it)[0] == 0
    it.close()
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.engine.cache.all_free()


def test_dtype_auto_is_the_checkpoints_and_the_default(tmp_path):
    import json

    import torch

    from hybridrt.llm import default_model

    small = {"max_model_len": 64, "cache_memory": 4 << 20}
    fp32 = write_random_checkpoint(tmp_path / "fp32", tiny_text_config(), seed=1)
    bf16 = write_random_checkpoint(tmp_path / "bf16", tiny_text_config(), seed=1,
                                   dtype=torch.bfloat16)
    assert LLM(fp32, **small).dtype == torch.float32  # no dtype in config.json: the weights'
    assert LLM(bf16, **small).dtype == torch.bfloat16
    assert LLM(bf16, dtype="float32", **small).dtype == torch.float32  # only when asked
    cfg = json.loads((bf16 / "config.json").read_text())
    cfg["text_config"]["dtype"] = "float16"  # declared in config.json: that one
    (bf16 / "config.json").write_text(json.dumps(cfg))
    assert LLM(bf16, **small).dtype == torch.float16
    demo = LLM(default_model(), **small)
    assert demo.dtype == torch.bfloat16 == demo.model.model.layers[0].mlp.up_proj.weight.dtype


def test_threads_like_the_cli_flag(tmp_path):
    import torch

    d = write_random_checkpoint(tmp_path, tiny_text_config(), seed=1)
    before = torch.get_num_threads()
    try:
        LLM(d, max_model_len=64, cache_memory=4 << 20, threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="threads"):
            LLM(d, threads=bad)


def test_no_sampling_params_means_the_generation_config(tmp_path):
    import json

    from hybridrt.llm import default_model

    demo = LLM(default_model(), max_model_len=64, cache_memory=4 << 20)
    p = demo.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.7, 0.8, 20, 256)
    d = write_random_checkpoint(tmp_path, tiny_text_config(), seed=1)
    write_char_tokenizer(d)
    (d / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "max_new_tokens": 3, "do_sample": False}))
    llm = LLM(d, max_model_len=64, cache_memory=4 << 20)
    explicit = SamplingParams(temperature=0, max_tokens=3)
    (out,) = llm.generate("abc", use_tqdm=False)
    (want,) = llm.generate("abc", explicit, use_tqdm=False)
    ids = want.outputs[0].token_ids
    assert out.outputs[0].token_ids == ids and len(ids) <= 3
    assert "".join(llm.stream("abc")) == want.outputs[0].text
    (d / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match="generation_config.json: top_p"):
        llm.generate("abc", use_tqdm=False)


def test_speculative_tokens_above_the_engines_k_fails_the_call(llm):
    for call in (lambda: llm.generate(["a", "b"], GREEDY, speculative_tokens=1),
                 lambda: llm.generate_iter(["a"], GREEDY, speculative_tokens=1),
                 lambda: llm.chat([{"role": "user", "content": "a"}], GREEDY,
                                  speculative_tokens=2),
                 lambda: llm.stream("a", GREEDY, speculative_tokens=1),  # before iterating
                 lambda: llm.stream_tokens("a", GREEDY, speculative_tokens=-1)):
        with pytest.raises(ValueError, match=r"speculative_tokens must be an integer in \[0, 0\]"):
            call()
        assert not llm.engine.requests and not llm.engine.has_unfinished_requests()


def test_bad_call_arguments_and_devices_raise_value_errors(llm, monkeypatch):
    import torch

    from hybridrt import ModelNotFoundError

    for bad in (None, 3):
        with pytest.raises(ValueError, match="prompts must be"):
            llm.generate(bad, GREEDY, use_tqdm=False)
    with pytest.raises(ModelNotFoundError, match="the model path is empty"):
        LLM("")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="CUDA is not available in this PyTorch build"):
        LLM(llm.model_path, device="cuda")
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
        LLM(llm.model_path, device="tpu")


def test_no_transformers_warning_about_long_prompts(capfd):
    from hybridrt.llm import default_model

    demo = LLM(default_model(), max_model_len=64, cache_memory=4 << 20)
    (out,) = demo.generate("hello world " * 3000, use_tqdm=False)  # 18000 tokens > 4096
    assert "max_model_len is 64" in str(out.error)
    assert "Token indices sequence length" not in capfd.readouterr().err


def test_default_step_budget_by_device(llm):
    """max_num_batched_tokens by default: 512 on CPU, 8192 on CUDA, within [block, context]."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert llm.engine.scheduler.max_num_batched_tokens == 256  # its max_model_len
    assert default_batched_tokens(cpu, 16, 4096) == 512
    assert default_batched_tokens(cuda, 16, 32768) == 8192
    assert default_batched_tokens(cuda, 16, 4096) == 4096
    assert default_batched_tokens(cpu, 1024, 4096) == 1024


def test_engine_args_hold_every_llm_option_with_its_default(llm):
    """``LLM(**options)`` builds one EngineArgs: the same keywords and defaults; the engine
    holds the resolved copy (model-dependent defaults filled)."""
    import dataclasses
    import inspect

    from hybridrt.engine_args import EngineArgs

    params = inspect.signature(LLM.__init__).parameters
    ours = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert ours == {n: p.default for n, p in params.items() if n != "self"}
    args = llm.engine.args
    assert (args.max_model_len, args.max_num_batched_tokens) == (256, 256)
    assert args.device == torch.device("cpu") and llm.engine.engine_config is args
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.max_num_seqs = 8


@pytest.mark.parametrize("option, value, message", [
    ("max_num_seqs", 0, "max_num_seqs must be a positive integer, got 0"),
    ("max_num_seqs", True, "max_num_seqs must be a positive integer, got True"),
    ("block_size", 2.0, "block_size must be a positive integer"),
    ("max_model_len", 1, "max_model_len must be an integer >= 2, got 1"),
    ("speculative_tokens", -1, "speculative_tokens must be an integer >= 0"),
    ("checkpoint_share", 1.0, r"checkpoint_share must be a number in \[0, 1\), got 1.0"),
    ("enable_prefix_caching", 1, "enable_prefix_caching must be True or False"),
    ("threads", 0, "threads must be a positive integer"),
    ("draft_vocab_size", 4, "needs speculative_tokens > 0"),
    ("cache_memory", -5, "cache_memory must be positive"),
    ("device", "tpu", "device must be cpu, cuda or cuda:N"),
])
def test_engine_args_reject_out_of_range_options_before_loading(option, value, message):
    from hybridrt.engine_args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**{option: value})
    with pytest.raises(ValueError, match=message):
        LLM("/nonexistent/checkpoint", **{option: value})  # checked before the load
