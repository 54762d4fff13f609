"""Per-request sampling settings, with vLLM's names, defaults and limits."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS): dividing logits by
# such a value only overflows towards the argmax anyway.
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 128  # choices of one request (each is a request of its own in the engine)


# Bad values raise ValueError, also for wrong types: the engine reports one exception type per
# bad request (style guide), hence the TRY004 waivers.


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number {allowed}, got {value!r}")  # noqa: TRY004
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite and {allowed}, got {value!r}")
    return value


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate (vLLM's names); exactly one of ``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object``, ``structural_tag``.

    | field | meaning |
    | --- | --- |
    | json | a JSON schema (dict or JSON text): the output is one JSON value valid against it |
    | regex | the output matches this regular expression (whole output) |
    | choice | the output is exactly one of these strings |
    | grammar | an EBNF grammar (xgrammar's / GBNF syntax; rule ``root`` is the start) |
    | json_object | True: the output is one JSON object, any keys |
    | structural_tag | xgrammar's structural tag (dict or JSON text): text with constrained parts |
    | disable_any_whitespace | True (our default; vLLM's is False): JSON laid out as
      ``json.dumps`` does (", " and ": "); False: any whitespace between tokens, in runs of
      at most 20 characters |

    Compiled by the engine (``hybridrt.structured_outputs``): a constraint that does not
    compile fails its own request, with the compiler's message.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    # True by default, unlike vLLM: with free whitespace a weak model fills every gap with
    # as much as it may (docs/structured_outputs.md)
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or "
                             f"its JSON text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not (isinstance(self.choice, list) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structured_outputs.structural_tag must be an object or its "
                             "JSON text")
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got {value!r}")  # noqa: TRY004

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar, json_object or structural_tag."""
        if self.json_object:
            return "json_object"
        return next(k for k in ("json", "regex", "choice", "grammar", "structural_tag")
                    if getattr(self, k) is not None)


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request (vLLM-compatible subset).

    | field | default | allowed |
    | --- | --- | --- |
    | temperature | 1.0 | >= 0, finite; < 1e-5 means greedy |
    | top_p | 1.0 | (0, 1] |
    | top_k | 0 | int >= -1; 0 and -1 disable it, 1 is greedy |
    | min_p | 0.0 | [0, 1] |
    | presence_penalty, frequency_penalty | 0.0 | [-2, 2] |
    | repetition_penalty | 1.0 | > 0, finite |
    | seed | None | int (per-request generator) or None (shared generator) |
    | max_tokens | 16 | int >= 1 or None (up to the context limit) |
    | min_tokens | 0 | int in [0, max_tokens] |
    | stop | None | str or list of non-empty str; normalised to a list |
    | stop_token_ids | None | list of ints >= 0; normalised to a list |
    | logprobs | None | None or int in [0, 20]: top logprobs returned besides the sampled one |
    | n | 1 | int in [1, 128]: choices, each its own request (seeded: seed + index) |
    | structured_outputs | None | StructuredOutputsParams (or a dict of its fields) |
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.temperature = _finite("temperature", self.temperature, ">= 0")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _finite("top_p", self.top_p, "in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(
                f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}"
            )
        self.min_p = _finite("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = _finite(name, getattr(self, name), "in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _finite("repetition_penalty", self.repetition_penalty, "> 0")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = _normalise_stop_token_ids(self.stop_token_ids)
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")  # noqa: TRY004
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an int in [1, {MAX_N}], got {self.n!r}")
        so = self.structured_outputs
        if isinstance(so, dict):
            unknown = sorted(set(so) - set(StructuredOutputsParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs: unknown fields {unknown}")
            self.structured_outputs = StructuredOutputsParams(**so)
        elif so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams or a dict, "
                             f"got {type(so).__name__}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax: temperature ~ 0 or top_k == 1."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def clone(self, **overrides: object) -> SamplingParams:
        """A validated copy with some fields replaced; the lists are copied, not shared."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"unknown SamplingParams fields {unknown}")
        overrides.setdefault("stop", list(self.stop))
        overrides.setdefault("stop_token_ids", list(self.stop_token_ids))
        return dataclasses.replace(self, **overrides)


def _normalise_stop(stop: object) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        stop = list(stop)
    else:
        raise ValueError(
            f"stop: unknown stop type {type(stop).__name__} ({stop!r}); "
            "expected a str or a list of str"
        )
    if any(not s for s in stop):
        raise ValueError("stop must not contain an empty string")
    return stop


def _normalise_stop_token_ids(ids: object) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"stop_token_ids must be a list of ints >= 0, got {ids!r}")
    return list(ids)
