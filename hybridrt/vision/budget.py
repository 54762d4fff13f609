"""One step's encoder work, budgeted by the scheduler (vLLM's encoder compute budget,
``max_num_encoder_input_tokens``).

An image costs its token count (merged tokens, as vLLM counts them) in the step that first
needs it: the step whose chunk of the request's prompt reaches one of its tokens, or, with MTP
drafts, the step whose chunk ends just before it (the MTP row at p reads token p+1). An image
the request holds already (encoded earlier, or found in the tower's encoder cache) costs
nothing. When an image does not fit what is left of the step's budget, the request's chunk
stops before it (before its first token, or one token earlier with MTP), and the image waits
for a later step while other requests decode. An image larger than the whole budget runs
alone: in a step whose budget nothing else has used. A video is one such item: it costs all
its frame groups' tokens, and a chunk stops before its first frame group.

The images a request is given are its ``VisionInputs.scheduled``; the runner's hook
(``hybridrt.vision.step.vision_step``) encodes every scheduled image of the step in one run
at its start.
"""

from __future__ import annotations


class EncoderBudget:
    """The image tokens one step may encode (``limit``) and how many it has given out
    (``used``)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0

    def fit(self, req, n: int) -> int:
        """The tokens of the request's next ``n`` (from ``num_computed_tokens``) it may
        compute this step, its images that need encoding given the budget on the way."""
        v, start = req.vision, req.num_computed_tokens
        ahead = 1 if req.spec_k else 0  # the MTP reads the token after the chunk
        v.scheduled = []
        for i in v.images_in(start, start + n + ahead):
            if v.held(i):
                continue
            cost = v.image_tokens(i)
            if self.used and self.used + cost > self.limit:
                return max(0, min(n, v.items[i].starts[0] - ahead - start))
            self.used += cost
            v.scheduled.append(i)
        return n
