"""``hybridrt serve --replicas N``: engine replicas as a Ray Serve deployment behind the same
OpenAI routes (the ``ray`` extra; nothing else in hybridrt imports this module).

Two deployments in one Ray Serve application:

- ``ingress`` (``Ingress`` holding a ``RayServer``; one replica, no CPU reserved):
  hybridrt.server's HTTP side (reading, limits, parsing, templating and tokenizing: 4xx
  here), then each request streamed from a replica and turned into a response or server-sent
  events; /metrics and /health over the replicas.
- ``engine`` (``EngineReplica``; N replicas or autoscaled, ``threads`` CPUs each): one ``LLM``
  and its ``EngineLoop``; ``generate(job)`` yields the request's progress; its prefix summary
  is its routing stats.

The ingress's handle to the engine deployment routes with ``hybridrt.ray_router``'s
``PrefixAwareRouter`` (or Ray Serve's power-of-two choice: ``router="pow2"``).

Failover (``RayServer._pump``): when the replica serving a request dies, a request that has sent
nothing to its client yet (a non-streaming one until it is whole, a stream until its first
piece) is sent again, to another replica, up to ``max_retries`` times; a stream that has begun
ends with an error event. Nothing is sent twice: a request is sent again only while nothing of
it has reached the client. Ray Serve starts a replacement for the dead replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import os
import signal
import threading

from ray import serve
from ray.exceptions import RayActorError

from hybridrt import openai_protocol as api
from hybridrt.prefix_routing import ROUTERS
from hybridrt.server import Frontend, Handle, Job, Progress, metrics_lines
from hybridrt.server.app import Server
from hybridrt.server.errors import internal_error
from hybridrt.server.metrics import family

log = logging.getLogger("hybridrt.ray_serve")
APP = "hybridrt"
ROUTERS_BY_NAME = {"prefix": "hybridrt.ray_router.PrefixAwareRouter",
                   "pow2": "hybridrt.ray_router.PowerOfTwoRouter"}


# The engine replica -------------------------------------------------------------------------
class EngineReplica:
    """One engine: ``LLM(model_path, **llm_options)`` run by an ``EngineLoop`` thread."""

    def __init__(self, model_path: str, llm_options: dict):
        from hybridrt.llm import LLM
        from hybridrt.server import EngineLoop

        self.llm = LLM(model_path, **llm_options)
        self.loop = EngineLoop(self.llm)
        self.loop.start()
        self.pid = os.getpid()
        self.name = serve.get_replica_context().replica_id.unique_id

    def describe(self) -> dict:
        """What the ingress needs to check prompts as this engine does."""
        return {"model_path": str(self.llm.model_path), "vocab_size": self.llm.config.vocab_size,
                "max_model_len": self.llm.engine.engine_config.max_model_len}

    async def generate(self, job: Job):
        """The progress of one prepared request (hybridrt.server.prepare's job), in batches of
        wire tuples (``_wire``); the request is aborted if the caller goes away first."""
        from hybridrt.server import submit_job

        handles = submit_job(self.loop, job)
        queue, n, done = handles[0].queue, len(handles), 0
        texts = [""] * n
        try:
            while done < n:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch = []
                for item in items:
                    batch.append(_wire(item, texts[item.index]))
                    texts[item.index] = item.text
                    done += item.finish_reason is not None
                yield batch
        finally:
            if done < n:
                for handle in handles:
                    self.loop.abort(handle)

    async def record_routing_stats(self) -> dict:
        """Ray Serve's routing stats: this engine's prefix summary (hybridrt.prefix_routing),
        read on the engine thread between two steps."""
        from hybridrt.prefix_routing import replica_summary

        return await asyncio.wrap_future(self.loop.call(replica_summary))

    def stats(self, replica: str | None = None) -> dict:
        """Counters and gauges for /metrics (``replica``: the name the caller routed to, which
        ``hybridrt.ray_router`` reads; checked here)."""
        if replica is not None and replica != self.name:
            raise RuntimeError(f"asked for replica {replica}, reached {self.name}")
        c = self.loop.counters
        return {"replica": self.name, "pid": self.pid, "alive": self.loop.thread.is_alive(),
                "counters": {**c, "requests": dict(c["requests"])},
                "gauges": dict(self.loop.gauges)}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine thread died is replaced."""
        if not self.loop.thread.is_alive():
            raise RuntimeError("the engine thread has stopped")

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()


def _wire(item: Progress, sent: str) -> tuple:
    """A Progress as the replica sends it: its text as (characters kept of what was sent
    before, what follows them) rather than whole (it is all the text so far, and a stop string
    found later can shorten it), its error as (kind, message)."""
    text = item.text
    keep = len(sent) if text.startswith(sent) else len(os.path.commonprefix([sent, text]))
    error = None
    if item.error is not None:
        error = ("bad" if isinstance(item.error, ValueError) else "error", str(item.error))
    return (item.index, item.new_token_ids, item.new_logprobs, keep, text[keep:],
            item.finish_reason, error, item.num_prompt_tokens, item.num_reused_tokens)


def _unwire(wire: tuple, texts: list[str]) -> Progress:
    index, ids, logprobs, keep, more, finish, error, num_prompt, num_reused = wire
    texts[index] = texts[index][:keep] + more
    err = None
    if error is not None:
        err = ValueError(error[1]) if error[0] == "bad" else RuntimeError(error[1])
    return Progress(ids, logprobs, texts[index], finish, err, num_prompt, num_reused, index)


# The ingress --------------------------------------------------------------------------------
class RayServer(Server):
    """hybridrt.server's endpoints with the engines in Ray Serve replicas behind ``engine``
    (a DeploymentHandle): each request is pumped from a replica's ``generate`` stream into
    the handles the HTTP side reads. ``target``: the replicas there should be (/health says
    "degraded" below it); ``max_retries``: times a request that sent nothing yet is sent again
    after its replica died."""

    def __init__(self, engine, front: Frontend, model_name: str, target: int = 1,
                 max_retries: int = 2, stats_timeout: float = 5.0, **server_options):
        super().__init__(None, model_name, front=front, **server_options)
        self.engine, self.target, self.max_retries = engine, target, max_retries
        self.stats_timeout = stats_timeout
        self.failover = {"retries": 0, "errors": 0}
        self._pumps: dict[int, asyncio.Task] = {}

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        try:
            yield
        finally:
            for task in list(self._pumps.values()):
                task.cancel()
            self.pool.shutdown(wait=False, cancel_futures=True)

    # Requests -------------------------------------------------------------------------------
    def submit(self, job: Job) -> list[Handle]:
        loop = asyncio.get_running_loop()
        shared: asyncio.Queue = asyncio.Queue()
        handles = [Handle(loop, shared, index=i) for i in range(job.params.n)]
        key = id(shared)
        task = loop.create_task(self._pump(handles, job))
        self._pumps[key] = task
        task.add_done_callback(lambda _: self._pumps.pop(key, None))
        return handles

    def abort(self, handles: list[Handle]) -> None:
        task = self._pumps.pop(id(handles[0].queue), None)
        if task is not None:
            task.cancel()

    async def _pump(self, handles: list[Handle], job: Job) -> None:
        """The request's progress from a replica into its handles. A stream's items go on as
        they come; a non-streaming request's are held until it is whole, so that a retry
        never follows something already delivered."""
        n, stream = len(handles), job.stream
        for attempt in itertools.count():
            texts, held, finished, delivered = [""] * n, [], set(), False
            gen = self.engine.options(stream=True).generate.remote(job)
            try:
                async for batch in gen:
                    for wire in batch:
                        item = _unwire(wire, texts)
                        if item.finish_reason is not None:
                            finished.add(item.index)
                        if stream:
                            handles[item.index].post(item)
                            delivered = True
                        else:
                            held.append(item)
                if len(finished) < n:
                    raise RuntimeError("the replica's stream ended before the request did")
                break
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as e:
                lost = isinstance(e, RayActorError)
                if lost and not delivered and attempt < self.max_retries:
                    self.failover["retries"] += 1
                    log.warning("replica lost before %s sent anything: retrying (%s)",
                                job.id, type(e).__name__)
                    continue
                if lost:
                    self.failover["errors"] += 1
                    log.warning("request %s: its replica died (%s)", job.id,
                                type(e).__name__)
                    error = api.ApiError(503, "the replica serving this request failed; "
                                              "nothing more will come", kind="server_error")
                else:  # a bug: logged whole, answered without internals
                    log.error("request %s failed", job.id, exc_info=e)
                    error = internal_error()
                for i in range(n):
                    if i not in finished:
                        handles[i].post(Progress([], None, texts[i], "error", error))
                return
        for item in held:
            handles[item.index].post(item)

    # Replicas -------------------------------------------------------------------------------
    async def replica_stats(self) -> dict[str, dict | None]:
        """Each replica the router knows -> its ``EngineReplica.stats`` (None: no answer within
        ``stats_timeout``)."""
        router = ROUTERS.get(self.engine.deployment_name)
        names = sorted(r.replica_id.unique_id for r in list(router.curr_replicas.values())) \
            if router is not None else []

        async def one(name: str):
            try:
                return await asyncio.wait_for(self.engine.stats.remote(replica=name),
                                              self.stats_timeout)
            except Exception:  # dead, restarting, or slow: reported as unreachable
                return None

        # each call in a task of its own, made in an empty context: calls made inside an HTTP
        # request share its Ray Serve request id, and Ray Serve's router matches a chosen
        # replica to its request by that id, so the second of two would wait forever
        tasks = [contextvars.Context().run(asyncio.ensure_future, one(x)) for x in names]
        return dict(zip(names, await asyncio.gather(*tasks)))

    async def health(self, request):
        from starlette.responses import JSONResponse

        stats = await self.replica_stats()
        healthy = sum(1 for s in stats.values() if s is not None and s["alive"])
        status = ("ok" if healthy >= self.target else "degraded") if healthy else "unavailable"
        replicas = {name: ({"pid": s["pid"], "running": s["gauges"]["running"],
                            "waiting": s["gauges"]["waiting"]} if s is not None and s["alive"]
                           else "unreachable") for name, s in stats.items()}
        return JSONResponse({"status": status, "healthy": healthy, "target": self.target,
                             "replicas": replicas}, status_code=200 if healthy else 503)

    async def metrics(self, request):
        from starlette.responses import PlainTextResponse

        if not self.metrics_public and (denied := self._auth(request)) is not None:
            return denied
        stats = await self.replica_stats()
        up = {name: s for name, s in stats.items() if s is not None}
        lines = metrics_lines([(f'replica="{name}"', s["counters"], s["gauges"])
                               for name, s in up.items()])
        lines += ["# HELP hybridrt_replica_info A replica answering, by name and process id.",
                  "# TYPE hybridrt_replica_info gauge"]
        lines += [f'hybridrt_replica_info{{replica="{name}",pid="{s["pid"]}"}} 1'
                  for name, s in up.items()]
        lines += family("replicas", "gauge", "Replicas by state.",
                         [('state="healthy"', sum(s["alive"] for s in up.values())),
                          ('state="unreachable"', len(stats) - len(up)),
                          ('state="target"', self.target)])
        lines += family("failover_retries_total", "counter",
                         "Requests sent again after their replica died before they sent "
                         "anything.", [("", self.failover["retries"])])
        lines += family("failover_errors_total", "counter",
                         "Requests ended with an error because their replica died.",
                         [("", self.failover["errors"])])
        router = ROUTERS.get(self.engine.deployment_name)
        rs = getattr(router, "stats", None)
        if rs is not None:
            lines += family("router_decisions_total", "counter",
                             "Requests routed, by why their replica was chosen.",
                             [(f'decision="{k}"', v) for k, v in sorted(rs["decisions"].items())])
            lines += family("router_prompt_tokens_total", "counter",
                             "Prompt tokens of the routed requests.", [("", rs["prompt_tokens"])])
            lines += family("router_matched_tokens_total", "counter",
                             "Prompt tokens the chosen replicas were believed to hold.",
                             [("", rs["matched_tokens"])])
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


class Ingress:
    """The ingress deployment: a ``RayServer`` whose prompt bounds come from a replica."""

    async def __init__(self, engine, model_path: str, model_name: str, options: dict):
        from hybridrt.llm import load_tokenizer

        info = await engine.describe.remote()
        front = Frontend(load_tokenizer(model_path), model_path, info["vocab_size"],
                         info["max_model_len"])
        self.server = RayServer(engine, front, model_name, **options)

    def __serve_build_asgi_app__(self):
        return self.server.app


# The application ----------------------------------------------------------------------------
def build_app(model_path: str, model_name: str, llm_options: dict, *, replicas: int = 2,
              autoscaling: dict | None = None, threads: int | None = None,
              device: str = "cpu", router: str = "prefix", max_imbalance: int = 4,
              recent_ttl: float = 10.0, stats_period: float = 1.0,
              max_ongoing_requests: int | None = None, server_options: dict | None = None):
    """The Ray Serve application: ``replicas`` engine replicas (or Ray Serve's
    ``autoscaling`` config: min_replicas, max_replicas, target_ongoing_requests, ...) of
    ``LLM(model_path, **llm_options, threads=threads, device=device)``, each reserving
    ``threads`` CPUs (and a GPU on cuda), behind one ingress. ``router``: "prefix" or "pow2"."""
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS_BY_NAME:
        raise ValueError(f"router must be one of {sorted(ROUTERS_BY_NAME)}, got {router!r}")
    kwargs = {"max_imbalance": max_imbalance, "recent_ttl": recent_ttl} if router == "prefix" \
        else {}
    max_seqs = llm_options.get("max_num_seqs", 32)
    engine = serve.deployment(
        name="engine",
        num_replicas=None if autoscaling else replicas,
        autoscaling_config=autoscaling,
        # room for a queue inside the engine (where requests sharing a prefix share its
        # prefill); beyond it, requests wait in the router, which can still choose for them
        max_ongoing_requests=max_ongoing_requests or 2 * max_seqs,
        ray_actor_options={"num_cpus": threads or 1,
                           "num_gpus": 1 if str(device).startswith("cuda") else 0},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS_BY_NAME[router], request_router_kwargs=kwargs,
            request_routing_stats_period_s=stats_period,
            request_routing_stats_timeout_s=max(5.0, 5 * stats_period)),
        health_check_period_s=2.0,
    )(EngineReplica)
    target = replicas if not autoscaling else int(autoscaling.get("min_replicas", 1) or 1)
    ingress = serve.deployment(name="ingress", num_replicas=1, max_ongoing_requests=4096,
                               ray_actor_options={"num_cpus": 0,
                                                  "runtime_env": _ingress_env()},
                               )(serve.ingress()(Ingress))
    options = {"target": target, **(server_options or {})}
    return ingress.bind(engine.bind(model_path, {**llm_options, "threads": threads,
                                                 "device": device}),
                        model_path, model_name, options)


def _ingress_env(environ=None) -> dict:
    """The ingress's runtime_env: one glibc malloc arena, as ``hybridrt serve`` has
    (server.one_malloc_arena, docs/server.md), since the ingress is where request bodies are
    parsed and refused; as an environment variable, because glibc reads it when the worker
    process starts, before any thread allocates. A MALLOC_ARENA_MAX or GLIBC_TUNABLES given
    here is passed on instead. The engines keep glibc's default: they parse nothing."""
    environ = os.environ if environ is None else environ
    if "arena_max" in environ.get("GLIBC_TUNABLES", ""):
        return {"env_vars": {"GLIBC_TUNABLES": environ["GLIBC_TUNABLES"]}}
    return {"env_vars": {"MALLOC_ARENA_MAX": environ.get("MALLOC_ARENA_MAX", "1")}}


def start_local_ray(num_cpus: int, object_store_mb: int = 128) -> None:
    """A Ray instance on this machine for this process only: its addresses on 127.0.0.1, no
    dashboard, a small object store (requests and progress are small), ``num_cpus`` CPUs to
    hand out. Ray's own gRPC ports still listen on every interface (it has no switch for
    that); Ray (2.52 and later) protects them with a token for a local instance."""
    import ray

    # address="local": a new instance even where another one runs, or ran, on this machine
    # (without it ray.init joins the one /tmp/ray/ray_current_cluster names, and fails)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
             _node_ip_address="127.0.0.1",
             object_store_memory=object_store_mb << 20, namespace=APP,
             configure_logging=False, log_to_driver=False)


def serve_replicas(model_path: str, model_name: str, llm_options: dict, *, host: str,
                   port: int, ray_address: str | None, replicas: int,
                   autoscaling: dict | None, threads: int | None, device: str, router: str,
                   max_imbalance: int, server_options: dict, announce=print) -> None:
    """``hybridrt serve --replicas``: start (or join) Ray, run the application on
    ``host:port`` until SIGINT or SIGTERM, then stop it: the application on a cluster that
    was already there, all of Ray when it was started here."""
    import ray

    cores = os.cpu_count() or 1
    if threads is None:
        threads = max(1, cores // max(1, replicas))
    if ray_address is None:
        most = (autoscaling or {}).get("max_replicas", replicas) or replicas
        start_local_ray(max(cores, most * threads))
    else:
        ray.init(address=ray_address, namespace=APP, log_to_driver=False)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        app = build_app(model_path, model_name, llm_options, replicas=replicas,
                        autoscaling=autoscaling, threads=threads, device=device, router=router,
                        max_imbalance=max_imbalance, server_options=server_options)
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        announce(f"hybridrt serve: {model_path} as {model_name!r} on http://{host}:{port}/v1, "
                 f"{'autoscaled ' + str(autoscaling) if autoscaling else replicas} replicas "
                 f"of {threads} thread(s), {router} routing, Ray at "
                 f"{ray_address or 'a local instance (127.0.0.1)'}")
        stop.wait()
    finally:
        announce("hybridrt serve: stopping")
        with contextlib.suppress(Exception):
            if ray_address is None:
                serve.shutdown()
            else:
                serve.delete(APP)
        ray.shutdown()
