"""Adaptive k on drawn acceptance: one request at a time through ``specdec.adaptive``'s own
``Acceptance`` and ``choose_ks``, each draft accepted with probability alpha, each step
charged what the cost model says (in one-row decode steps). Prints, per request length and
alpha, adaptive k's tokens per step against k = 0's and against the best fixed k's, and a
request whose acceptance moves from 0.2 to 0.8 halfway against the best choice of each half.

    python -m hybridrt.bench.adaptive_sim [--draft-pass 0.38 --verify 0.07 --verify-row 0]
        [--probe-pass 0.10]   # one-draft rounds through the probe head (a 248k vocabulary's)
        [--set PRIOR=2 --set IDLE_FORGET=0.97]   # other constants, to compare

The default costs are the 0.8B shape's on the CPU with the full-vocabulary MTP head
(docs/speculation.md: a k = 1 step about 1.45 decode steps, each further draft about 0.4).
No model runs: what is measured is the choice, not the engine."""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

from hybridrt.specdec import adaptive
from hybridrt.specdec.stats import SpecStats


def run(alpha_at, tokens: int, requests: int, cost: adaptive.CostModel, cap: int = 4,
        seed: int = 0, probe: float | None = None) -> float:
    """Tokens per unit of cost over ``requests`` requests of ``tokens`` tokens; draft j of a
    round is accepted with probability ``alpha_at(tokens so far)`` given the earlier ones were.
    ``probe``: a probe round's draft pass (``specdec.adaptive.Candidate.probe_round``: a
    round of one draft goes through the probe head), charged and priced in place of
    ``cost.draft_pass``."""
    rng = random.Random(seed)
    if probe is not None:
        cost = replace(cost, probe_pass=probe)
    spent = made = 0.0
    for _ in range(requests):
        stats, n = SpecStats(cap), 0  # the engine's bookkeeping of a request's rounds
        while n < tokens:
            c = min(cap, tokens - n - 1, stats.acceptance.earned("mtp"))
            k, passes = 0, 0.0
            if c > 0:
                alpha = stats.acceptance.optimistic("mtp")
                cand = adaptive.Candidate(c, 48 + n, [alpha] * c, [True] * c, probe is not None)
                k = adaptive.choose_ks([cand], 1, cost)[0]
                passes = cand.pass_cost(k, cost)
            spent += cost.step(1 + k, 0, k > 0) + passes
            stats.proposed(k, 0)  # k = 0: the idle forgetting
            a, alpha = 0, alpha_at(n)
            while a < k and rng.random() < alpha:
                a += 1
            if k:
                stats.record(k, a)
            n += a + 1
        made += n
    return made / spent


def fixed(alpha: float, cost: adaptive.CostModel, cap: int = 4) -> list[float]:
    """Tokens per unit of cost of k = 0 .. cap, fixed."""
    return [(1 + adaptive.expected_gain([alpha] * k, k))
            / (cost.step(1 + k, 0, k > 0) + cost.draft_pass * k) for k in range(cap + 1)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft-pass", type=float, default=0.38)
    ap.add_argument("--verify", type=float, default=0.07)
    ap.add_argument("--verify-row", type=float, default=0.0,
                    help="a verify step's cost per row beyond a plain step's (16k deep: 0.14)")
    ap.add_argument("--probe-pass", type=float, default=None,
                    help="a probe's draft pass (the probe head's; the 0.8B shape's: 0.10)")
    ap.add_argument("--alphas", default="0.2,0.5,0.8")
    ap.add_argument("--tokens", default="48,512", help="request lengths")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="one of specdec.adaptive's constants (FORGET, IDLE_FORGET, PRIOR, BONUS)")
    a = ap.parse_args(argv)
    for kv in a.set:
        name, _, value = kv.partition("=")
        if name not in ("FORGET", "IDLE_FORGET", "PRIOR", "BONUS"):
            ap.error(f"--set: unknown constant {name!r}")
        setattr(adaptive, name, float(value))
    cost = adaptive.CostModel(row=0.02, compute_row=0.0, verify=a.verify,
                              verify_row=a.verify_row, draft_pass=a.draft_pass)
    print(f"FORGET {adaptive.FORGET} IDLE_FORGET {adaptive.IDLE_FORGET} PRIOR {adaptive.PRIOR} "
          f"BONUS {adaptive.BONUS}; draft pass {a.draft_pass}, verify {a.verify}, "
          f"verify row {a.verify_row}, probe pass {a.probe_pass}")
    print("| tokens | alpha | adaptive / k = 0 | adaptive / best fixed k | best k |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    def requests(tokens: int) -> int:  # about as many tokens at every length
        return max(20, a.requests * 48 // tokens)

    for tokens in map(int, a.tokens.split(",")):
        for alpha in map(float, a.alphas.split(",")):
            got = run(lambda n, al=alpha: al, tokens, requests(tokens), cost, probe=a.probe_pass)
            ks = fixed(alpha, cost)
            best = max(range(len(ks)), key=ks.__getitem__)
            print(f"| {tokens} | {alpha} | {got / ks[0]:.3f} | {got / ks[best]:.3f} | {best} |")
    tokens = max(map(int, a.tokens.split(",")))
    half = tokens // 2
    got = run(lambda n: 0.2 if n < half else 0.8, tokens, requests(tokens), cost,
              probe=a.probe_pass)
    ideal = tokens / (half / max(fixed(0.2, cost)) + (tokens - half) / max(fixed(0.8, cost)))
    print(f"acceptance 0.2 then 0.8 from token {half} of {tokens}: {got / ideal:.3f} of the best "
          "fixed k of each half")


if __name__ == "__main__":
    main()
