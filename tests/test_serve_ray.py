"""`hybridrt serve --replicas`: two Ray Serve replicas of the demo model (1 thread each) on a
local Ray (127.0.0.1, 2 CPUs), spoken to over HTTP; outputs pinned to a cold ``LLM.generate``
of the same prompt ids in this process (fp32, greedy). Which replica served a request is read
from the per-replica counters of /metrics.

The failover test kills a replica's process and runs last (the deployment serves again
afterwards, which it checks). Bounded: Ray and the application start once for the module
(about a minute on a loaded 2-core machine), every wait has a deadline."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from hybridrt import LLM, SamplingParams  # noqa: E402
from hybridrt.llm import default_model  # noqa: E402

MODEL = "hybridrt-demo"
OPTIONS = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 8,
           "cache_memory": 256 << 20}  # room for every test's conversations: no eviction
RECENT_TTL = 2.0  # the router's memory of what it sent where; replicas report every 0.5 s
QUESTIONS = ["What does json.dumps do?", "Which module provides deque?",
             "What is the signature of os.path.join?", "What does re.sub return?",
             "How do I read a file line by line?", "What does itertools.chain do?",
             "What is functools.lru_cache for?", "What does shutil.copy do?"]
TURNS = ["What does json.dumps do?", "And json.loads?", "Which module provides deque?",
         "What is os.path.join for?"]


class Cluster:
    """The application's HTTP side and what /metrics and /health say."""

    def __init__(self, base: str):
        self.base = base
        self.http = httpx.Client(base_url=base, timeout=120)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def wait_healthy(self, n: int, seconds: float, not_pid: int | None = None) -> dict:
        deadline = time.time() + seconds
        while True:
            try:
                h = self.health()
                pids = [r["pid"] for r in h["replicas"].values() if isinstance(r, dict)]
                if h["healthy"] == n and len(pids) == n and not_pid not in pids:
                    return h
            except (httpx.HTTPError, json.JSONDecodeError):
                h = None
            assert time.time() < deadline, f"not {n} healthy replicas after {seconds} s: {h}"
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in self.http.get("/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def per_replica(self, metric: str) -> dict[str, float]:
        """``hybridrt_<metric>`` by replica name."""
        out = {}
        for name, value in self.metrics().items():
            if name.startswith(f"hybridrt_{metric}{{replica="):
                out[name.split('"')[1]] = value
        return out

    def served(self) -> dict[str, float]:
        """Finished requests by replica (every finish reason)."""
        out: dict[str, float] = {}
        for name, value in self.metrics().items():
            if name.startswith("hybridrt_requests_total{replica="):
                replica = name.split('"')[1]
                out[replica] = out.get(replica, 0) + value
        return out

    def chat(self, messages: list[dict], **fields) -> dict:
        r = self.http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 16, **fields})
        assert r.status_code == 200, r.text
        return r.json()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The command (first: before this process starts its own Ray) ---------------------------------
def test_bench_serve_runs_hybridrt_serve_replicas_and_stops_it(tmp_path, monkeypatch):
    """`hybridrt bench serve --replicas 1`: the real command with a local Ray, loaded, then
    stopped by SIGTERM (exit 0: Ray Serve and Ray shut down). Its own Ray even where another
    cluster is named (RAY_ADDRESS here; /tmp/ray/ray_current_cluster after a `ray start`):
    without --ray-address, ray.init would try to join it."""
    from hybridrt.bench import serve as servebench

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:9")  # nothing listens there

    report = servebench.run(conversations=2, turns=2, max_tokens=4, time_limit=120, threads=1,
                            replicas=[1], json_path=tmp_path / "serve.json")
    (r,) = report["runs"]
    assert (r["replicas"], r["router"], r["requests"], r["errors"]) == (1, "prefix", 4, 0)
    assert r["server_exit"] == 0
    assert 0 < r["hit_rate"] < 1 and r["prefilled_tokens"] == r["prompt_tokens"] - \
        r["reused_tokens"]


class _Dies:
    """A replica's ``generate`` stream that sends ``before`` batches, then dies as a killed
    replica's does (RayActorError); with nothing to send before, the next call answers."""

    def __init__(self, before):
        self.before, self.calls = before, 0

    def options(self, stream):
        return self

    @property
    def generate(self):
        return self

    def remote(self, payload):
        self.calls += 1
        return self._stream(self.calls)

    async def _stream(self, call):
        from ray.exceptions import RayActorError

        if call == 1:
            for batch in self.before:
                yield batch
            raise RayActorError()
        yield [(0, [7, 8], None, 0, "ab", "length", None, 3, 0)]


def _pump(stream: bool, before) -> tuple[list, dict, int]:
    """RayServer._pump of one request against ``_Dies(before)`` -> (what its handle got, the
    failover counters, the replica calls)."""
    import types

    from hybridrt.ray_serve import RayServer
    from hybridrt.server import Job

    got = []
    handle = types.SimpleNamespace(post=got.append, index=0)
    engine = _Dies(before)
    server = types.SimpleNamespace(engine=engine, max_retries=2,
                                   failover={"retries": 0, "errors": 0})
    job = Job([1, 2, 3], SamplingParams(max_tokens=2), None, None, "r", stream=stream)
    asyncio.run(RayServer._pump(server, [handle], job))
    return got, server.failover, engine.calls


def test_failover_sends_a_plain_request_again():
    """A non-streaming request whose replica dies is sent again, even after the replica had
    produced part of it (held, never delivered), and delivered whole, once."""
    partial = [[(0, [7], None, 0, "a", None, None, 3, 0)]]
    for before in ([], partial):
        got, failover, calls = _pump(False, before)
        assert failover == {"retries": 1, "errors": 0} and calls == 2
        assert [(p.new_token_ids, p.text, p.finish_reason) for p in got] == [([7, 8], "ab",
                                                                              "length")]


def test_failover_cuts_a_stream_that_began():
    """A stream whose replica dies after sending something is not sent again (that would
    repeat what the client has): what came stays, then an error, once; a stream that had sent
    nothing is sent again."""
    got, failover, calls = _pump(True, [[(0, [7], None, 0, "a", None, None, 3, 0)]])
    assert failover == {"retries": 0, "errors": 1} and calls == 1
    assert [p.text for p in got] == ["a", "a"] and got[0].error is None
    assert got[1].finish_reason == "error" and "replica" in str(got[1].error)
    got, failover, calls = _pump(True, [])
    assert failover == {"retries": 1, "errors": 0} and calls == 2
    assert [p.text for p in got] == ["ab"]



def test_the_router_reads_the_prompt_of_a_generate_call():
    """The prefix-aware router routes on the prompt ids of the ``Job`` a ``generate`` call
    carries; a call without one (describe, stats) has none."""
    import types

    from hybridrt.ray_router import _prompt_ids
    from hybridrt.server import Job

    job = Job([1, 2, 3], SamplingParams(max_tokens=2), None, None, "r")
    assert _prompt_ids(types.SimpleNamespace(args=(job,))) == [1, 2, 3]
    assert _prompt_ids(types.SimpleNamespace(args=())) is None
    assert _prompt_ids(None) is None

def test_the_application_passes_replicas_threads_device_and_autoscaling_through():
    """``build_app``'s deployments as Ray Serve will run them (nothing started): per-replica
    CPUs and GPU, a fixed count or Ray Serve's autoscaling config, the ingress's arena."""
    from hybridrt.ray_serve import _ingress_env, build_app

    def parts(app):
        ingress = app._bound_deployment
        return ingress, ingress.init_args[0]._bound_deployment

    ingress, engine = parts(build_app("m", "n", {"max_num_seqs": 8}, replicas=3, threads=2))
    assert (engine.num_replicas, engine.ray_actor_options) == (3, {"num_cpus": 2,
                                                                   "num_gpus": 0})
    assert engine.init_args == ("m", {"max_num_seqs": 8, "threads": 2, "device": "cpu"})
    assert engine._deployment_config.max_ongoing_requests == 16
    assert ingress.init_args[1:] == ("m", "n", {"target": 3})
    assert ingress.ray_actor_options["runtime_env"] == {"env_vars": {"MALLOC_ARENA_MAX": "1"}}
    scaled = {"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 3}
    ingress, engine = parts(build_app("m", "n", {}, autoscaling=scaled, threads=1,
                                      device="cuda:0"))
    config = engine._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == \
        (2, 5, 3)
    assert engine.ray_actor_options == {"num_cpus": 1, "num_gpus": 1}
    assert ingress.init_args[3] == {"target": 2}
    with pytest.raises(ValueError, match="router must be one of"):
        build_app("m", "n", {}, router="random")
    assert _ingress_env({"MALLOC_ARENA_MAX": "8"}) == {"env_vars": {"MALLOC_ARENA_MAX": "8"}}
    tunable = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert _ingress_env(tunable) == {"env_vars": tunable}


@pytest.fixture(scope="module")
def cluster():
    from ray import serve

    from hybridrt.ray_serve import APP, build_app, start_local_ray

    start_local_ray(num_cpus=2)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(default_model(), MODEL, OPTIONS, replicas=2, threads=1,
                        recent_ttl=RECENT_TTL, stats_period=0.5)
        serve.run(app, name=APP, route_prefix="/", blocking=False)
        c = Cluster(f"http://127.0.0.1:{port}")
        c.wait_healthy(2, 300)
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def ref():
    return LLM(**OPTIONS)


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    return llm.tokenizer.encode(llm.apply_chat_template(messages), add_special_tokens=False)


def cold(ref: LLM, prompts: list, max_tokens: int = 16) -> list[str]:
    return [o.text for o in cold_outputs(ref, prompts, max_tokens)]


def cold_outputs(ref: LLM, prompts: list, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0] for o in ref.generate(prompts, params, use_tqdm=False)]


def user(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def _events(lines: list[str]) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in lines if line.startswith("data: ")]


# Same outputs as one engine ------------------------------------------------------------------
def test_two_replicas_answer_what_one_engine_answers(cluster, ref):
    prompts = [f"{i}: {q}" for i, q in enumerate(QUESTIONS)]
    want_chat = cold(ref, [chat_ids(ref, user(p)) for p in prompts])
    want_text = cold(ref, prompts)
    before = cluster.served()

    async def one(client, i):
        chat = i % 2 == 0
        body = {"model": MODEL, "temperature": 0, "max_tokens": 16, "ignore_eos": True,
                "stream": i % 4 >= 2}
        if chat:
            body["messages"] = user(prompts[i])
        else:
            body["prompt"] = prompts[i]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if not body["stream"]:
            r = await client.post(path, json=body)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return c["message"]["content"] if chat else c["text"]
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            events = _events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        pieces = [e["choices"][0].get("delta", {}).get("content") if chat else
                  e["choices"][0]["text"] for e in events[:-1] if e.get("choices")]
        return "".join(p or "" for p in pieces)

    async def all_of_them():
        async with httpx.AsyncClient(base_url=cluster.base, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    got = asyncio.run(all_of_them())
    assert got == [want_chat[i] if i % 2 == 0 else want_text[i] for i in range(len(prompts))]
    after = cluster.served()
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after), (before, after)
    # n > 1: the choices of one request, run as child requests on one replica
    r = cluster.chat(user(prompts[0]), n=2, ignore_eos=True)
    assert [c["message"]["content"] for c in r["choices"]] == [want_chat[0]] * 2


# Prefix-aware routing --------------------------------------------------------------------------
def _turn(cluster: Cluster, ref: LLM, msgs: list[dict], q: str) -> tuple[str, int, dict]:
    """One more turn of ``msgs`` (extended in place), checked against a cold run -> (the
    replica that prefilled it, its prompt ids, its usage)."""
    msgs.append({"role": "user", "content": q})
    before = cluster.per_replica("prefill_tokens_total")
    r = cluster.chat(msgs)
    after = cluster.per_replica("prefill_tokens_total")
    ids = chat_ids(ref, msgs)
    (o,) = ref.generate([ids], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    answer = r["choices"][0]["message"]["content"]
    assert answer == o.outputs[0].text
    msgs.append({"role": "assistant", "content": answer})
    grew = {name: after[name] - before.get(name, 0) for name in after
            if after[name] != before.get(name, 0)}
    assert len(grew) == 1, f"one replica prefills a request: {before} -> {after}"
    (replica, prefilled), = grew.items()
    u = r["usage"]
    assert prefilled == u["prompt_tokens"] - u["prompt_tokens_details"]["cached_tokens"]
    return replica, len(ids), u


def _check_affinity(turns: list[tuple[str, int, dict]]) -> None:
    """Every turn on the first turn's replica, each reusing all of the previous turn (its
    prompt and answer but the answer's last token, never computed)."""
    assert {replica for replica, _, _ in turns} == {turns[0][0]}, turns
    for (_, prev_len, prev), (_, _, u) in zip(turns, turns[1:]):
        assert u["prompt_tokens_details"]["cached_tokens"] == \
            prev_len + prev["completion_tokens"] - 1


def test_conversation_turns_land_on_the_replica_holding_their_prefix(cluster, ref):
    """Turns sent the moment the previous answer ends: the router remembers where it sent
    the conversation."""
    for c in range(4):
        msgs = [{"role": "system", "content": f"Conversation {c}."}]
        _check_affinity([_turn(cluster, ref, msgs, q) for q in TURNS])


def test_turns_after_a_pause_follow_the_replicas_reports(cluster, ref):
    """Turns after the router has forgotten what it sent (RECENT_TTL): the replicas' own
    prefix summaries (routing stats) lead the next turns to them."""
    convs = [[{"role": "system", "content": f"Paused conversation {c}."}] for c in range(2)]
    turns: list[list] = [[], []]
    for q in TURNS:
        for c in range(2):
            turns[c].append(_turn(cluster, ref, convs[c], q))
        time.sleep(RECENT_TTL + 1.5)
    for t in turns:
        _check_affinity(t)
    m = cluster.metrics()
    assert m['hybridrt_router_decisions_total{decision="prefix"}'] >= 6


# Bad requests ----------------------------------------------------------------------------------
def test_bad_requests_get_4xx_from_the_ingress(cluster):
    before = cluster.served()
    h = cluster.http
    r = h.post("/v1/chat/completions", content=b"{not json",
               headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = h.post("/v1/chat/completions", json={"model": "gpt-4", "messages": user("hi")})
    assert r.status_code == 404
    r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 10**9})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = h.post("/v1/completions", content=b"x" * (5 << 20),
               headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert h.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert cluster.served() == before  # refused before any replica saw them


def _pids_of(title: str) -> list[int]:
    """Processes whose command line (Ray sets it to the actor's name) starts with ``title``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if f.read().startswith(title.encode()):
                        pids.append(int(entry))
            except OSError:  # gone, or not ours to read
                pass
    return pids


def test_the_ingress_runs_with_one_malloc_arena(cluster):
    """The ingress parses and refuses request bodies: like ``hybridrt serve``, its threads
    share glibc's main arena, so that malloc_trim hands a refused body's memory back
    (test_serve_limits.py's test_memory_of_refused_requests_is_handed_back has the why)."""
    from test_serve_limits import thread_heaps

    (ingress,) = _pids_of("ray::ServeReplica:hybridrt:ingress")
    r = cluster.http.post("/v1/completions", content=b"x" * (5 << 20),
                          headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert not thread_heaps(ingress)
    engines = _pids_of("ray::ServeReplica:hybridrt:engine")
    assert len(engines) == 2 and all(thread_heaps(pid) for pid in engines)  # the check sees


# Failover (last: it kills a replica) ----------------------------------------------------------
def test_killed_replica_loses_no_request_and_comes_back(cluster, ref):
    """Eight streams and eight plain requests in flight on both replicas; one replica's
    process is killed. Every plain request gets its whole answer (sent again to the other
    replica), every stream either its whole answer or, if its replica died after it began, a
    prefix of it and an error event: never a piece twice. Then Ray Serve has replaced the
    replica and the deployment serves on both."""
    n, max_tokens = 16, 200
    prompts = [f"k{i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(n)]
    outs = cold_outputs(ref, [chat_ids(ref, user(p)) for p in prompts], max_tokens)
    want = [o.text for o in outs]
    pieces = [[ref.tokenizer.decode([t], skip_special_tokens=False) for t in o.token_ids]
              for o in outs]
    retries_before = cluster.metrics()["hybridrt_failover_retries_total"]
    started: set[int] = set()
    streams = {i for i in range(n) if i % 4 in (0, 3)}

    async def one(client, i, prompt):
        body = {"model": MODEL, "messages": user(prompt), "temperature": 0,
                "max_tokens": max_tokens, "ignore_eos": True, "stream": i in streams,
                "logprobs": True, "stream_options": {"include_usage": True}}
        if not body["stream"]:
            r = await client.post("/v1/chat/completions", json=body)
            return r.status_code, r.json()
        lines = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                lines.append(line)
                if '"content": "' in line and '"content": ""' not in line:
                    started.add(i)
        return r.status_code, _events(lines)

    async def load():
        async with httpx.AsyncClient(base_url=cluster.base, timeout=180) as client:
            tasks = [asyncio.create_task(one(client, i, p)) for i, p in enumerate(prompts)]
            deadline = time.time() + 120
            while len(started) < n // 2:
                assert time.time() < deadline, "the streams did not start"
                await asyncio.sleep(0.02)
            replicas = (await client.get("/health")).json()["replicas"]
            victim = max(replicas.values(), key=lambda r: r["running"] + r["waiting"])
            os.kill(victim["pid"], signal.SIGKILL)
            done, pending = await asyncio.wait(tasks, timeout=180)
            assert not pending, "a request hung after its replica was killed"
            return victim["pid"], [t.result() for t in tasks]

    victim_pid, results = asyncio.run(load())
    cut = 0
    for i, (status, body) in enumerate(results):
        assert status == 200, body
        if i not in streams:
            assert body["choices"][0]["message"]["content"] == want[i]
            continue
        chunks = [e["choices"][0] for e in body if isinstance(e, dict) and e.get("choices")]
        text = "".join(c["delta"].get("content") or "" for c in chunks)
        # one logprobs entry a token sent: a token sent twice would show here even where the
        # text is held back and cut to what was sent already
        tokens = [x["token"] for c in chunks for x in (c["logprobs"] or {}).get("content", [])]
        errors = [k for k, e in enumerate(body) if isinstance(e, dict) and "error" in e]
        if not errors:
            assert text == want[i]
            assert tokens == pieces[i]
            usage = [e["usage"] for e in body if isinstance(e, dict) and e.get("usage")]
            assert usage[0]["completion_tokens"] == max_tokens
            continue
        cut += 1
        assert want[i].startswith(text), (i, text, want[i])  # what came, came once
        assert tokens == pieces[i][:len(tokens)], (i, tokens)
        assert all(not isinstance(e, dict) or not e.get("choices") for e in body[errors[0]:])
    retries = cluster.metrics()["hybridrt_failover_retries_total"] - retries_before
    # the kill hit work in flight: a plain request sent again or a stream cut. Which kinds the
    # killed replica held is the prefix router's choice, so not both are asserted here; each
    # branch is pinned without a cluster (test_failover_*)
    assert retries + cut >= 1, (retries, cut)

    cluster.wait_healthy(2, 240, not_pid=victim_pid)
    before = cluster.served()
    prompts = [f"again {i}: {q}" for i, q in enumerate(QUESTIONS[:4])]  # nothing cached
    want = cold(ref, [chat_ids(ref, user(p)) for p in prompts], max_tokens)

    async def again():
        async with httpx.AsyncClient(base_url=cluster.base, timeout=120) as client:
            return await asyncio.gather(*(one(client, 1, p) for p in prompts))

    for w, (status, body) in zip(want, asyncio.run(again())):
        assert status == 200 and body["choices"][0]["message"]["content"] == w
    after = cluster.served()
    assert len(after) == 2 and all(after[r] > before.get(r, 0) for r in after), (before, after)
