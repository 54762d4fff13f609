"""Ray Serve request routers for the engine deployment of ``hybridrt serve --replicas``
(hybridrt.ray_serve): ``PrefixAwareRouter`` (the rule of hybridrt.prefix_routing) and
``PowerOfTwoRouter`` (Ray Serve's default, to compare against). Both send a call that names a
replica (a ``replica=`` keyword: the ingress asks each replica for /metrics and /health) to that
replica only, and register themselves in ``prefix_routing.ROUTERS`` so that the ingress, in
whose process a handle's router runs, can list the replicas and read the routing counters (not
here: Ray Serve pickles a router's module by value, so a dict of this module would be a copy).

Imported only with Ray installed (the ``ray`` extra), by hybridrt.ray_serve.
"""

from __future__ import annotations

from collections import OrderedDict

# Ray's default router (a deployment without a request_router_config gets it); its module is
# not among ray.serve's public names
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    RequestRouter,
    RunningReplica,
)

import hybridrt.prefix_routing as routing
from hybridrt.prefix_routing import PrefixTable, prompt_chain, rank
from hybridrt.server.job import Job

DECISIONS = ("prefix", "overloaded", "least_loaded")


def _target(candidates: list[RunningReplica], pending: PendingRequest | None):
    """The ranks for a call that names its replica (only that one: none while it is not
    running, and Ray Serve retries until the caller's timeout); None for any other call."""
    name = pending.kwargs.get("replica") if pending is not None and pending.kwargs else None
    if name is None:
        return None
    pending.routing_context.should_backoff = True
    found = [r for r in candidates if r.replica_id.unique_id == name]
    return [found] if found else []


class PowerOfTwoRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray Serve's default choice (two random replicas, the less loaded one), plus named
    calls. Without the default's FIFO mixin, which hands a replica chosen for one request to
    the oldest waiting one: a named call must get its own."""

    def initialize_state(self, **kwargs):
        routing.ROUTERS[self._deployment_id.name] = self
        self.stats = None

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        targeted = _target(candidate_replicas, pending_request)
        if targeted is not None:
            return targeted
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(
            self, candidate_replicas, pending_request)


class PrefixAwareRouter(RequestRouter):
    """A request goes to the replica holding the longest cached prefix of its prompt unless
    that replica's ongoing requests exceed the least loaded one's by more than
    ``max_imbalance``; otherwise, or with nothing cached, to the least loaded. Replicas report
    their prefix summaries as routing stats (``EngineReplica.record_routing_stats``); prompts
    sent to a replica count as held there for ``recent_ttl`` seconds. Requests are matched to
    the replica chosen for them (no FIFO mixing: that would hand a replica chosen for one
    prompt to another)."""

    def initialize_state(self, max_imbalance: int = 4, recent_ttl: float = 10.0):
        routing.ROUTERS[self._deployment_id.name] = self
        self.max_imbalance = max_imbalance
        self.table = PrefixTable(recent_ttl=recent_ttl)
        # what the ingress exports: decisions, and the prompt tokens the chosen replicas were
        # believed to hold (the router's own estimate of its hit rate)
        self.stats = {"decisions": dict.fromkeys(DECISIONS, 0), "prompt_tokens": 0,
                      "matched_tokens": 0}
        self._decided: OrderedDict[str, tuple] = OrderedDict()  # request id -> its decision

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        targeted = _target(candidate_replicas, pending_request)
        if targeted is not None:
            return targeted
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        ids = _prompt_ids(pending_request)
        loads = await self._loads(candidate_replicas)
        if ids is None:  # not a generation (describe): least loaded
            return rank(candidate_replicas, {}, loads, self.max_imbalance)[0]
        chains: dict[tuple, list[bytes]] = {}
        matched = {}
        for r in candidate_replicas:
            self.table.report(r.replica_id, r.routing_stats)
            params = self.table.chain_params(r.replica_id)
            if params is None:
                continue
            if params not in chains:
                chains[params] = prompt_chain(ids, *params)
            matched[r] = self.table.matched_blocks(r.replica_id, chains[params])
        ranks, decision = rank(candidate_replicas, matched, loads, self.max_imbalance)
        rid = pending_request.metadata.internal_request_id
        self._decided[rid] = (decision, len(ids), chains,
                              {r.replica_id: n for r, n in matched.items()})
        while len(self._decided) > 4096:  # requests cancelled before they were routed
            self._decided.popitem(last=False)
        return ranks

    async def _loads(self, candidates: list[RunningReplica]) -> dict:
        """Each candidate's ongoing requests: Ray Serve's cached count, else asked (None when
        a replica does not answer in time)."""
        loads, missing = {}, []
        for r in candidates:
            q = (self._replica_queue_len_cache.get(r.replica_id)
                 if self._use_replica_queue_len_cache else None)
            if q is None:
                missing.append(r)
            else:
                loads[r] = q
        if missing:
            for r, q in await self._probe_queue_lens(missing, 0):
                loads[r] = q
        return loads

    def on_request_routed(self, pending_request, replica_id, result):
        decided = self._decided.pop(pending_request.metadata.internal_request_id, None)
        if decided is None:
            return
        decision, num_tokens, chains, matched = decided
        self.stats["decisions"][decision] += 1
        self.stats["prompt_tokens"] += num_tokens
        params = self.table.chain_params(replica_id)
        chain = chains.get(params)
        if chain is not None:
            self.stats["matched_tokens"] += matched.get(replica_id, 0) * params[1]
            self.table.routed(replica_id, chain)

    def update_replicas(self, replicas):
        before = set(self._replica_id_set)
        super().update_replicas(replicas)
        for gone in before - set(self._replica_id_set):
            self.table.forget(gone)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id)


def _prompt_ids(pending: PendingRequest | None) -> list[int] | None:
    """The prompt ids of an ``EngineReplica.generate`` call (its one argument, the job)."""
    if pending is None or not pending.args or not isinstance(pending.args[0], Job):
        return None
    return pending.args[0].ids
