"""A request body -> a ``Job`` (hybridrt.server.job), in a pool thread: the body parsed and
validated (hybridrt.openai_protocol), the chat template applied, the prompt tokenized and
fitted within max_model_len, tool choice turned into a constraint, a constraint put after the
think block the prompt leaves open (hybridrt.think_constraint). A chat with http(s) image URLs
is handed back as a ``MediaWait``: the app fetches them (hybridrt.vision.fetch) and calls
``resume``. Every refusal is an ``ApiError`` (a 4xx); nothing here knows HTTP."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrt import openai_protocol as api
from hybridrt.output_pipeline import Shape
from hybridrt.reasoning import opens_thinking
from hybridrt.sampling_params import SamplingParams
from hybridrt.server.errors import too_many_tokens
from hybridrt.server.job import Job
from hybridrt.think_constraint import after_think
from hybridrt.tool_calls import tool_constraint
from hybridrt.vision import inputs as vision_inputs
from hybridrt.vision.fetch import MediaError, MediaPolicy, is_http_url


@dataclass(slots=True)
class Frontend:
    """What the HTTP side needs of a model, weights aside: its tokenizer (and chat template),
    its directory (the generation defaults) and a prompt's bounds. ``of(llm)``: a loaded
    model's; ``hybridrt.ray_serve``'s ingress builds one from the checkpoint's files."""

    tokenizer: Any
    model_path: str
    vocab_size: int
    max_model_len: int
    vision_refusal: str | None = None  # why images are refused (None: read the checkpoint)
    vision: object | None = None  # the loaded tower (hybridrt.vision.tower.VisionTower)

    @classmethod
    def of(cls, llm) -> Frontend:
        return cls(llm.tokenizer, str(llm.model_path), llm.config.vocab_size,
                   llm.engine.engine_config.max_model_len, llm.vision_refusal, llm.vision)

    def apply_chat_template(self, messages: list[dict], kwargs: dict | None,
                            add_generation_prompt: bool) -> str:
        from hybridrt.tokenizer import apply_chat_template

        return apply_chat_template(self.tokenizer, messages, kwargs, add_generation_prompt)

    def validate_prompt(self, ids) -> list[int]:
        from hybridrt.request import validate_prompt

        return validate_prompt(ids, self.vocab_size, self.max_model_len)


@dataclass(slots=True)
class MediaWait:
    """A chat request whose images include http(s) URLs (each allowed by the policy): the
    parsed ``body`` (its translation's ``echo``) waits while the app fetches ``urls``."""

    body: dict
    chat: bool
    echo: dict | None
    urls: list[str]


class _NeedsFetch(Exception):
    def __init__(self, urls: list[str]):
        self.urls = urls


class Preparer:
    """Prepares the requests of one server: its model's ``Frontend``, the name it serves,
    the limits (resolved), which image URLs it may fetch (``media``) and the checkpoint's
    generation defaults."""

    def __init__(self, front: Frontend, model_name: str, limits: api.Limits,
                 media: MediaPolicy | None = None):
        from hybridrt.model_path import generation_defaults

        self.front, self.model_name, self.limits = front, model_name, limits
        self.media = media if media is not None else MediaPolicy()
        self.tokenizer, self.max_model_len = front.tokenizer, front.max_model_len
        self.defaults = generation_defaults(front.model_path)
        self.vision_refusal = front.vision_refusal or (
            "this server's replicas do not take images yet"
            if vision_inputs.has_vision_tower(front.model_path)
            else vision_inputs.refusal_reason(False))

    def parse(self, raw: bytes, chat: bool, translate=None) -> Job | MediaWait:
        """In a pool thread: the body -> the job (``prepare``), or a ``MediaWait`` where it
        has image URLs to fetch first; ``translate``: another API's body -> (the chat
        completion body it asks for, what its answer echoes: ``Job.api``). A refusal is raised
        without the traceback of where it was found: those frames hold the parsed body and the
        prompt's encoding, which must be freed before the server trims the heap."""
        try:
            body, echo = api.parse_body(raw, self.limits.max_json_depth), None
            if translate is not None:
                (body, echo), chat = translate(body), True
            try:
                return self._job(body, chat, echo)
            except _NeedsFetch as e:
                return MediaWait(body, chat, echo, e.urls)
        except api.ApiError as e:
            error = e.with_traceback(None)
        del raw
        raise error

    def resume(self, wait: MediaWait, fetched: dict[str, bytes]) -> Job:
        """In a pool thread: a ``MediaWait``'s job, its URLs' bodies ``fetched``."""
        try:
            return self._job(wait.body, wait.chat, wait.echo, fetched)
        except api.ApiError as e:
            error = e.with_traceback(None)
        raise error

    def _job(self, body: Any, chat: bool, echo: dict | None,
             fetched: dict[str, bytes] | None = None) -> Job:
        job = self.prepare(body, chat, fetched)
        if echo is not None:
            job.api = echo
        return job

    def prepare(self, body: Any, chat: bool, fetched: dict[str, bytes] | None = None) -> Job:
        """Validate a request body -> its job: prompt ids, text, params, snapshot point,
        shape. ``fetched``: the bodies of its image URLs (None: not fetched yet, and
        ``_NeedsFetch`` is raised where it has some)."""
        api.check_common(body, self.model_name)
        api.check_limits(body, self.limits)
        params = api.sampling_params(body, self.defaults, chat)
        snapshot_at, tools, choice, parallel, vision = None, None, "none", True, None
        if chat:
            if self.tokenizer is None:
                raise api.bad("this model has no tokenizer, so it has no chat template")
            media = self._media(body, fetched)
            messages = api.chat_messages(body, images=media is not None)
            kwargs = api.template_kwargs(body)
            tools, choice, parallel = api.chat_tools(body)
            if tools:
                kwargs["tools"] = tools
            gen = body.get("add_generation_prompt", True)
            try:
                text = self.front.apply_chat_template(messages, kwargs, gen)
                base = self.front.apply_chat_template(messages, kwargs, False) if gen else None
            except Exception as e:
                raise api.bad(f"the chat template failed on these messages: {e}",
                              "messages") from None
            ids = self._encode(text, body, "messages")
            if base is not None:
                base_ids = self._encode(base, body, "messages")
                if 0 < len(base_ids) < len(ids) and ids[:len(base_ids)] == base_ids:
                    snapshot_at = len(base_ids)
            if media is not None:  # each image's and video's placeholder expanded
                try:
                    ids, vision = self.front.vision.prepare(
                        ids, *media, lambda s: self.tokenizer.encode(s, add_special_tokens=False))
                except ValueError as e:
                    raise api.bad(str(e), "messages") from None
                if snapshot_at is not None:  # the images are all before it
                    snapshot_at += vision.num_added
        else:
            refused = vision_inputs.multi_modal_refusal(body, self.vision_refusal)
            if refused is not None:
                raise api.bad(refused, "multi_modal_data")
            prompt = api.completion_prompt(body)
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise api.bad("this model has no tokenizer: send token ids", "prompt")
                text, ids = prompt, self._encode(prompt, body, "prompt")
            else:
                text, ids = None, prompt
        where, num_ids = "messages" if chat else "prompt", len(ids)
        ids, params = self._fit(ids, params, body, where)
        if len(ids) != num_ids:
            if vision is not None:
                raise api.bad("truncate_prompt_tokens would cut a prompt with images",
                              "truncate_prompt_tokens")
            snapshot_at = None  # truncated: the rendered prefix is no longer at the start
        try:
            ids = self.front.validate_prompt(ids)
            if vision is None and self.front.vision is not None:
                self.front.vision.check_text_only(ids)
        except ValueError as e:
            raise api.bad(str(e), where) from None
        thinks = chat and text is not None and opens_thinking(text)
        if choice not in ("none", "auto"):  # required / named: the output is made calls
            if params.structured_outputs is not None:
                raise api.bad(f"tool_choice {_short_choice(choice)} makes the output tool "
                              f"calls: it cannot go with response_format or "
                              f"structured_outputs", "tool_choice")
            try:
                params = params.clone(structured_outputs=tool_constraint(
                    tools, choice, thinks, parallel))
            except ValueError as e:
                raise api.bad(str(e), "tools") from None
        elif thinks and params.structured_outputs is not None:  # the constraint after </think>
            try:
                params = params.clone(structured_outputs=after_think(params.structured_outputs))
            except ValueError as e:
                raise api.bad(str(e), "response_format") from None
        opts = body.get("stream_options") or {}
        return Job(ids, params, text, snapshot_at, api.new_id("chatcmpl" if chat else "cmpl"),
                   api.now(), Shape(thinks, tools if choice != "none" else None, parallel),
                   params.logprobs or 0, bool(body.get("stream")),
                   bool(opts.get("include_usage")), vision)

    def _media(self, body: dict, fetched: dict[str, bytes] | None) -> tuple[list, list] | None:
        """A chat's (images, videos) (data URLs, and the bytes ``fetched`` from http(s) URLs),
        its parts made ``{"type": "image"}`` / ``{"type": "video"}`` in ``body["messages"]``;
        None where it has none. Refused (400) where the model has no tower, for more images or
        videos than the per-prompt limits, for a URL the media policy does not allow, and for
        anything else but a data URL (no server file is read). ``_NeedsFetch`` (body
        untouched) where it has allowed URLs and ``fetched`` is None."""
        messages = body.get("messages")
        if not vision_inputs.media_parts(messages):
            return None
        if self.front.vision is None:
            raise api.bad(vision_inputs.media_refusal(messages, self.vision_refusal),
                          "messages")
        try:
            messages, images, videos = vision_inputs.chat_media(messages)
            vision_inputs.check_media_count("image", len(images), self.front.vision.max_images)
            vision_inputs.check_media_count("video", len(videos), self.front.vision.max_videos)
        except ValueError as e:
            raise api.bad(str(e), "messages") from None
        urls = []
        for i, url in enumerate(images + videos):
            if is_http_url(url):
                try:
                    self.media.check(url)
                except MediaError as e:
                    raise api.bad(str(e), "messages") from None
                urls.append(url)
            elif not (isinstance(url, str) and url.startswith("data:")):
                what = f"image {i}" if i < len(images) else f"video {i - len(images)}"
                raise api.bad(f"{what}: refused, the server takes images and videos as data "
                              f"URLs (data:image/png;base64,...) or http(s) URLs of the hosts "
                              f"its operator allows (--allowed-media-domains) only; no server "
                              f"file is read", "messages")
        if urls and fetched is None:
            raise _NeedsFetch(urls)
        body["messages"] = messages
        return ([fetched[u] if is_http_url(u) else u for u in images],
                [fetched[u] if is_http_url(u) else u for u in videos])

    def _fit(self, ids: list[int], params: SamplingParams, body: dict,
             where: str) -> tuple[list[int], SamplingParams]:
        """The prompt and max_tokens within max_model_len: a prompt cut to its last
        ``truncate_prompt_tokens`` tokens (-1: as many as fit); a prompt over the token limit,
        or whose client-given max_tokens cannot fit beside it, refused; a default max_tokens
        lowered to the room left."""
        n, cap = self.max_model_len, self.limits.max_prompt_tokens
        explicit = any(body.get(k) is not None for k in ("max_tokens", "max_completion_tokens"))
        truncate = body.get("truncate_prompt_tokens")
        if truncate is not None:
            keep = truncate if truncate > 0 else n - (params.max_tokens or 1)
            ids = ids[-max(1, min(keep, cap)):]
        if len(ids) > cap:
            raise too_many_tokens(len(ids), cap, n, where)
        room = n - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            if explicit:
                raise api.bad(f"the prompt has {len(ids)} tokens and max_tokens is "
                              f"{params.max_tokens}: together over max_model_len {n} (at most "
                              f"{room} for this prompt; or send truncate_prompt_tokens)",
                              "max_tokens")
            params = params.clone(max_tokens=max(1, room),
                                  min_tokens=min(params.min_tokens, max(1, room)))
        return ids, params

    def _encode(self, text: str, body: dict, where: str) -> list[int]:
        """The text's ids. A fast tokenizer's encoding is measured before its ids become a
        Python list: a prompt over the token limit (and not to be truncated) is refused
        without making a few hundred thousand int objects, whose memory would stay with the
        process. ``encode_batch``, not ``encode``: only the batch call releases the GIL (a
        3.5 MB prompt held it 3.1 s with ``encode``, stalling the event loop from the pool)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return self.tokenizer.encode(text, add_special_tokens=False)
        (encoding,) = backend.encode_batch([text], add_special_tokens=False)
        if len(encoding) > self.limits.max_prompt_tokens and \
                body.get("truncate_prompt_tokens") is None:
            raise too_many_tokens(len(encoding), self.limits.max_prompt_tokens,
                                   self.max_model_len, where)
        return encoding.ids


def _short_choice(choice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice["function"]["name"])
