"""n > 1: one request's n choices, run as n child requests of one parent (vLLM v1's shape).

The engine runs one choice per request; ``ParentRequest`` splits a request with
``SamplingParams.n > 1`` into children ``"{i}_{parent id}"`` (each ``Request.parent_id`` is
the parent's id, so a prefix cache can let the children share the prompt's prefill), each
with ``n = 1`` and its own seed stream (``seed + i`` when the parent is seeded, else the
shared generator), and joins their outputs into one ``RequestOutput`` whose ``outputs[i]``
is choice i.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrt.outputs import RequestOutput
from hybridrt.sampling_params import SamplingParams


@dataclass(slots=True)
class ParentRequest:
    request_id: str
    params: SamplingParams
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # choice -> its output

    @property
    def n(self) -> int:
        return self.params.n

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s params: n = 1, seed + index when seeded."""
        seed = self.params.seed
        return self.params.clone(n=1, seed=None if seed is None else seed + index)

    def children(self) -> list[tuple[str, SamplingParams]]:
        return [(self.child_id(i), self.child_params(i)) for i in range(self.n)]

    def add(self, index: int, out: RequestOutput) -> RequestOutput | None:
        """Record choice ``index``'s finished output -> the joined output once all n are in."""
        self.outputs[index] = out
        if len(self.outputs) < self.n:
            return None
        return self.joined()

    def joined(self) -> RequestOutput:
        """The children's outputs as one: ``outputs[i]`` is choice i (index i); metrics and
        the prompt from choice 0, the first error of any."""
        outs = [self.outputs[i] for i in sorted(self.outputs)]
        first = outs[0]
        choices = []
        for i, o in zip(sorted(self.outputs), outs):
            c = o.outputs[0]
            c.index = i
            choices.append(c)
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids, outputs=choices,
            finished=all(o.finished for o in outs), metrics=first.metrics,
            error=next((o.error for o in outs if o.error is not None), None),
            num_cached_tokens=first.num_cached_tokens)
