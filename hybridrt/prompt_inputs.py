"""What a caller passes as a prompt, made into what the engine takes: text, token ids, a dict
with images (vLLM's ``multi_modal_data``) or a chat conversation -> (text or None, token ids,
the images' VisionInputs or None). Owns the prompt's use of the tokenizer and the vision tower,
and the refusal of images a model cannot take (never dropped)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from hybridrt.tokenizer import apply_chat_template
from hybridrt.tool_calls import template_messages
from hybridrt.vision import inputs as vision_inputs

PromptType = str | Sequence[int] | dict


def as_prompt_list(prompts) -> list:
    """One prompt or a list of them -> a list of prompts."""
    if prompts is None or not isinstance(prompts, (str, dict, Sequence, Iterator)):
        raise ValueError(f"prompts must be a prompt (text, token ids or a dict) or a list "
                         f"of them, got {type(prompts).__name__}")
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompts
    ):
        return [prompts]
    return list(prompts)


def prompt_text(prompt) -> str:
    """A prompt's text: the prompt itself, or a dict's "prompt"; "" where it has none (token
    ids, a refused prompt)."""
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    return text if isinstance(text, str) else ""


class PromptEncoder:
    """tokenizer: the model's (None: token ids only); vision: the loaded tower
    (hybridrt.vision.tower.VisionTower, None: text only); vision_refusal: why images are
    refused without it."""

    def __init__(self, tokenizer, vision, vision_refusal: str | None):
        self.tokenizer = tokenizer
        self.vision = vision
        self.vision_refusal = vision_refusal

    def encode(self, prompt: PromptType):
        """-> (text or None, token ids, the images' VisionInputs or None)."""
        if isinstance(prompt, vision_inputs.RefusedPrompt):
            raise prompt.error
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") not in (None, {}):
            if self.vision is None:
                raise ValueError(vision_inputs.multi_modal_refusal(prompt, self.vision_refusal))
            text, ids = self.encode_text(prompt)
            images, videos = vision_inputs.multi_modal_media(prompt["multi_modal_data"])
            ids, vision = self.vision.prepare(ids, images, videos, self._tokenize)
            return text, ids, vision
        text, ids = self.encode_text(prompt)
        if self.vision is not None:
            self.vision.check_text_only(ids)
        return text, ids, None

    def encode_text(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompt token ids instead")
            if not prompt:
                raise ValueError("prompt is empty: it must contain at least one token")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
            return None, list(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def chat_prompt(self, conversation: list[dict], kwargs: dict, add_generation_prompt: bool):
        """One conversation's prompt: its text, or with image or video parts {"prompt": text,
        "multi_modal_data": {"image": [...], "video": [...]}}; a ``RefusedPrompt`` where it
        holds a part the model cannot take (its request alone fails)."""
        if not vision_inputs.media_parts(conversation):
            return apply_chat_template(self.tokenizer, template_messages(conversation), kwargs,
                                       add_generation_prompt)
        if self.vision is None:
            refused = vision_inputs.media_refusal(conversation, self.vision_refusal)
            return vision_inputs.RefusedPrompt(ValueError(refused))
        try:
            messages, images, videos = vision_inputs.chat_media(conversation)
        except ValueError as e:
            return vision_inputs.RefusedPrompt(e)
        text = apply_chat_template(self.tokenizer, template_messages(messages), kwargs,
                                   add_generation_prompt)
        return {"prompt": text, "multi_modal_data": {"image": images, "video": videos}}

    def _tokenize(self, text: str) -> list[int]:
        """Text inserted into a prompt (a video's timestamps), tokenized on its own."""
        if self.tokenizer is None:
            raise ValueError("a video's timestamps are text: it needs the model's tokenizer")
        return self.tokenizer.encode(text, add_special_tokens=False)
