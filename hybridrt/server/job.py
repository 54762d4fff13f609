"""``Job``: one HTTP request, prepared (hybridrt.server.prepare): what the engine runs and how
its outputs are answered. It travels as it is to a Ray Serve engine replica
(hybridrt.ray_serve), so it pickles."""

from __future__ import annotations

from dataclasses import dataclass

from hybridrt.output_pipeline import Shape
from hybridrt.sampling_params import SamplingParams


@dataclass(slots=True)
class Job:
    """``ids``, ``params``, ``prompt`` (its text; None for token ids) and ``snapshot_at``
    (where the rendered conversation ends before the generation prompt: a prefix-cache
    checkpoint) are the engine's; ``id`` and ``created`` name the response; ``shape`` says how
    its text is split and parsed; ``top``: top logprobs per token; ``stream``: server-sent
    events; ``usage``: a stream ends with a usage chunk; ``api``: for a request of another API
translated into a chat completion (Anthropic Messages, OpenAI Responses), what its answer
needs of the original request."""

    ids: list[int]
    params: SamplingParams
    prompt: str | None
    snapshot_at: int | None
    id: str
    created: int = 0
    shape: Shape = Shape()
    top: int = 0
    stream: bool = False
    usage: bool = False
    vision: object | None = None  # the prompt's images (hybridrt.vision.tower.VisionInputs)
    api: dict | None = None
