"""A bounded fuzz of `hybridrt serve` on loopback (issue 29): a fixed number of random mutations
of valid requests (chat and text completions, Anthropic Messages and count_tokens, OpenAI
Responses) (wrong types, sizes, encodings, truncated bodies, slow senders and readers),
sent from a few threads within a time limit. The server never answers 500, /health never goes
unanswered for a second, and a clean request afterwards is served exactly (greedy, fp32) with
nothing left in the cache."""

from __future__ import annotations

import json
import random
import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")
pytest.importorskip("openai")

from test_serve import Running, chat_ids, cold, make_llm, user  # noqa: E402
from test_serve_limits import HealthWatch, port_of  # noqa: E402

from hybridrt.openai_protocol import Limits  # noqa: E402

SEED, COUNT, TIME_LIMIT, THREADS = 29, 240, 90.0, 4
BODY_LIMIT = 64 << 10
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs",
          "top_logprobs", "stream", "stream_options", "n", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
          "skip_special_tokens", "include_stop_str_in_output", "chat_template_kwargs",
          "enable_thinking", "add_generation_prompt", "truncate_prompt_tokens", "tools",
          "response_format", "best_of", "echo", "user",
          # Anthropic Messages and OpenAI Responses
          "system", "stop_sequences", "thinking", "tool_choice", "metadata", "output_config",
          "input", "instructions", "max_output_tokens", "text", "reasoning",
          "previous_response_id", "parallel_tool_calls", "truncation"]
BLOCKS = ["text", "image", "tool_use", "tool_result", "thinking", "input_text", "output_text",
          "function_call", "function_call_output", "reasoning", "message", "input_image"]


@pytest.fixture(scope="module")
def ref():
    return make_llm(max_model_len=256)


@pytest.fixture(scope="module")
def srv():
    s = Running(make_llm(max_model_len=256),
                limits=Limits(max_body_bytes=BODY_LIMIT), body_timeout=2.0)
    yield s
    s.stop()


# Mutations ------------------------------------------------------------------------------------
def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 3 else 8)
    return [
        lambda: None, lambda: rng.choice([True, False]), lambda: rng.randint(-3, 40),
        lambda: rng.choice([2 ** 63, 2 ** 70, -2 ** 64, 10 ** 12, -1, 0]),
        lambda: rng.choice([0.0, -0.5, 1e308, 3.5, 1e-9]),
        lambda: rng.choice(["", "x", "yes", "user", "hybridrt-demo", "\ud800", "é" * 50,
                            "\x00", "[DONE]"]),
        lambda: "w" * rng.choice([10, 1000, 70_000]),
        lambda: rng.choice([[], {}, [1], ["a"], [None]]),
        lambda: [random_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {rng.choice(FIELDS + ["role", "content", "type", "text"]):
                 random_value(rng, depth + 1) for _ in range(rng.randrange(4))},
        lambda: [{"role": rng.choice(["user", "assistant", "system", "wizard", 7]),
                  "content": random_value(rng, depth + 1)} for _ in range(rng.randrange(3))],
        lambda: [{"type": rng.choice(["text", "image_url", *BLOCKS]), "text": random_value(rng, 3),
                  rng.choice(["id", "tool_use_id", "call_id", "input", "content", "name"]):
                  random_value(rng, 3)}],
    ][kind]()


def valid_request(rng: random.Random) -> tuple[str, dict]:
    stream = rng.random() < 0.3
    common = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.7]),
              "stream": stream}
    question = rng.choice(["hi", "What does json.dumps do?", "x " * 20])
    route = rng.random()
    if route < 0.45:
        return "/v1/chat/completions", {"model": "hybridrt-demo", "messages": user(question),
                                        **common}
    if route < 0.6:
        return "/v1/completions", {"prompt": rng.choice(["import os\n", [5, 6, 7], "def f():"]),
                                   **common}
    if route < 0.8:
        path = rng.choice(["/v1/messages"] * 4 + ["/v1/messages/count_tokens"])
        return path, {"model": "hybridrt-demo", "system": "Be brief.", "messages": [
            {"role": "user", "content": [{"type": "text", "text": question}]}], **common}
    body = {"model": "hybridrt-demo", "instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": question}]}], **common}
    body["max_output_tokens"] = body.pop("max_tokens")
    return "/v1/responses", body


def mutate(rng: random.Random) -> tuple[str, bytes, str]:
    """-> (path, body bytes, how to send it)."""
    path, body = valid_request(rng)
    for _ in range(rng.randrange(1, 4)):
        op = rng.randrange(5)
        if op == 0:  # a field's value of another type or size
            body[rng.choice(list(body))] = random_value(rng)
        elif op == 1:  # a field added
            body[rng.choice(FIELDS)] = random_value(rng)
        elif op == 2 and isinstance(body.get("messages"), list):
            body["messages"] = body["messages"] * rng.choice([2, 100, 600])
        elif op == 3:
            body.pop(rng.choice(list(body)), None)
        elif op == 4:  # the text itself: odd characters in an otherwise valid request
            text = rng.choice(["\ud800", "\udfff x", "a\x00b", "é\u200b" * 30, "\U0001f600"])
            if isinstance(body.get("messages"), list):
                body["messages"] = user(text)
            elif "prompt" in body:
                body["prompt"] = text
    if rng.random() < 0.15:
        body = random_value(rng)  # not even an object
    data = json.dumps(body, ensure_ascii=rng.random() < 0.5).encode("utf-8", "surrogatepass")
    enc = rng.randrange(10)
    if enc == 0:  # invalid bytes somewhere
        at = rng.randrange(len(data) + 1)
        data = data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 4))) + data[at:]
    elif enc == 1:
        data = json.dumps(body).encode("utf-16")
    elif enc == 2:
        data = b"\xef\xbb\xbf" + data  # a byte-order mark
    elif enc == 3:
        data = b"[" * rng.choice([33, 5000, 200_000]) + data
    how = rng.choices(["whole", "truncated", "short", "slow", "idle", "slow-reader"],
                      weights=[60, 10, 8, 6, 4, 6])[0]
    if how == "truncated":  # a body cut short, with its (shorter) length declared
        data = data[:rng.randrange(len(data) + 1)]
    return path, data, how


# Sending ---------------------------------------------------------------------------------------
def send(port: int, path: str, data: bytes, how: str, rng: random.Random) -> tuple[int, bytes]:
    """One request on its own connection -> (status or 0 for no answer, response bytes)."""
    length = len(data) + (rng.randint(1, 100) if how in ("short", "idle") else 0)
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        try:
            if how == "slow":  # a slow sender, within the body deadline
                sock.sendall(head)
                for i in range(0, len(data), max(1, len(data) // 8)):
                    sock.sendall(data[i:i + max(1, len(data) // 8)])
                    time.sleep(0.05)
            else:
                sock.sendall(head + data)
            if how == "short":  # promised more than it sent, then hung up
                sock.shutdown(socket.SHUT_WR)
            # "idle": promised more and waits: the server's body deadline answers
        except OSError:  # the server answered (413) and closed while we were sending
            pass
        out = b""
        try:
            while True:
                if how == "slow-reader":
                    time.sleep(0.02)
                chunk = sock.recv(512 if how == "slow-reader" else 65536)
                if not chunk:
                    break
                out += chunk
                if how == "slow-reader" and len(out) > 2000:
                    break  # gives up reading: the server sees a disconnect
        except OSError:
            pass
    if not out.startswith(b"HTTP/1.1 "):
        return 0, out
    return int(out.split(b" ", 2)[1]), out


def test_fuzzed_requests_never_get_a_500_and_the_server_stays_healthy(srv, ref):
    port = port_of(srv)
    results: list[tuple[str, str, int, bytes]] = []
    deadline = time.monotonic() + TIME_LIMIT
    lock = threading.Lock()
    jobs = iter(range(COUNT))

    def worker(n: int):
        rng = random.Random(SEED * 1000 + n)
        while time.monotonic() < deadline:
            with lock:
                i = next(jobs, None)
            if i is None:
                return
            path, data, how = mutate(rng)
            status, out = send(port, path, data, how, rng)
            with lock:
                results.append((path, how, status, out[:300]))

    with HealthWatch(srv.base) as watch:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=TIME_LIMIT + 60)
    statuses = [r[2] for r in results]
    summary = {s: statuses.count(s) for s in sorted(set(statuses))}
    print(f"\n{len(results)} fuzzed requests: {summary}; /health worst "
          f"{watch.worst * 1000:.0f} ms over {watch.count} checks")
    assert len(results) >= COUNT // 2, "too few requests within the time limit"
    fives = [r for r in results if r[2] >= 500 or b'"code":500' in r[3].replace(b" ", b"")
             or b'"api_error"' in r[3] or b'"server_error"' in r[3]]
    assert not fives, fives[:3]
    unanswered = [r for r in results if r[2] == 0 and r[1] not in ("short", "slow-reader")]
    assert not unanswered, unanswered[:3]
    assert 200 in summary and 400 in summary
    for path in ("/v1/messages", "/v1/responses"):  # the other APIs' routes were fuzzed too
        assert {r[2] for r in results if r[0] == path} >= {200, 400}, path
    assert watch.worst < 1.0
    # afterwards: a clean request served exactly, nothing held but the cached prefixes
    msgs = user("What does json.dumps do?")
    r = srv.client.chat.completions.create(model="hybridrt-demo", messages=msgs, temperature=0,
                                           max_tokens=12)
    assert r.choices[0].message.content == cold(ref, chat_ids(ref, msgs), max_tokens=12
                                                ).outputs[0].text
    m = srv.wait_idle()
    assert m["hybridrt_cache_blocks_used"] == 0
