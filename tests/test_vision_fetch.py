"""http(s) image URLs on the server (hybridrt.vision.fetch): fetched only from the hosts the
operator allows, within a size and a time limit, a redirect followed only to an allowed host;
a fetched image gives the tokens the same image gives as a data URL; every refusal (and more
images than the per-prompt limit) is a one-line 400 for its own request; a slow URL holds no
parse worker. A loopback HTTP server (http.server in a thread) serves the images."""

from __future__ import annotations

import base64
import io
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from vision_helpers import image, write_vision_checkpoint

from hybridrt import LLM, SamplingParams
from hybridrt.vision.fetch import MediaError, MediaPolicy, parse_domains

pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

STEPS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS)


def png(h: int, w: int, seed: int) -> bytes:
    buf = io.BytesIO()
    image(h, w, seed).save(buf, format="PNG")
    return buf.getvalue()


class Images(BaseHTTPRequestHandler):
    """The loopback image server's routes (``self.server.state``: the PNGs, and the events
    the slow route waits on)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        st = self.server.state
        st["hits"].append(self.path)
        route = self.path.split("?")[0]
        if route in st["png"]:
            return self._send(200, st["png"][route], "image/png")
        if route == "/slow.png":  # answers once the test releases it
            st["slow_started"].set()
            st["release"].wait(300)
            return self._send(200, st["png"]["/a.png"], "image/png")
        if route == "/to-a.png":  # a redirect on the same host
            return self._redirect("/a.png")
        if route == "/to-other.png":  # a redirect to a host not allowed
            return self._redirect(f"http://127.0.0.1:{self.server.server_port}/other.png")
        if route == "/page.html":
            return self._send(200, b"<html>not an image</html>", "text/html; charset=utf-8")
        if route == "/big.png":  # a Content-Length over the limit
            return self._send(200, b"\0" * 50_000, "image/png")
        if route == "/endless.png":  # no Content-Length: the size is counted while reading
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            for _ in range(50):
                self.wfile.write(b"\0" * 1000)
            return None
        if route == "/stall.png":  # never answers within the timeout
            st["release"].wait(30)
            return self._send(200, st["png"]["/a.png"], "image/png")
        return self._send(404, b"no such image", "text/plain")

    def _send(self, status: int, body: bytes, kind: str):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, to: str):
        self.send_response(302)
        self.send_header("Location", to)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def images():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    srv.daemon_threads = True
    srv.state = {"png": {"/a.png": png(24, 32, 10), "/b.png": png(40, 24, 11)}, "hits": [],
                 "slow_started": threading.Event(), "release": threading.Event()}
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.state["release"].set()
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = write_vision_checkpoint(tmp_path_factory.mktemp("vision"), seed=3)
    return LLM(path, dtype="float32", max_model_len=256, cache_memory="32MiB")


def chat_body(*urls: str, max_tokens: int = STEPS) -> dict:
    parts = [{"type": "text", "text": "Look: "}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": max_tokens,
            "temperature": 0}


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def running(llm, **options):
    from test_serve import Running

    return Running(llm, **options)


def test_a_fetched_image_answers_as_the_same_image_as_a_data_url(llm, images):
    """The fetched PNG (directly and through a same-host redirect; two images, one of them
    twice) gives the answer and prompt tokens that the same PNGs as data URLs give."""
    port = images.server_port
    a, b = images.state["png"]["/a.png"], images.state["png"]["/b.png"]
    srv = running(llm, media=MediaPolicy(("localhost",), timeout=20))
    try:
        post = lambda body: httpx.post(f"{srv.base}/v1/chat/completions", json=body,  # noqa: E731
                                       timeout=120)
        for urls, raws in [([f"http://localhost:{port}/a.png"], [a]),
                           ([f"http://LocalHost:{port}/to-a.png"], [a]),
                           ([f"http://localhost:{port}/b.png", f"http://localhost:{port}/a.png",
                             f"http://localhost:{port}/b.png"], [b, a, b])]:
            got = post(chat_body(*urls))
            want = post(chat_body(*map(data_url, raws)))
            assert got.status_code == 200 and want.status_code == 200, (got.text, want.text)
            assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
            assert got.json()["usage"]["prompt_tokens"] == want.json()["usage"]["prompt_tokens"]
        (direct,) = llm.chat(chat_body(data_url(a))["messages"], GREEDY, use_tqdm=False)
        r = post(chat_body(f"http://localhost:{port}/a.png"))
        assert r.json()["choices"][0]["message"]["content"] == direct.outputs[0].text
        assert r.json()["usage"]["prompt_tokens"] == len(direct.prompt_token_ids)
    finally:
        srv.stop()


def test_each_refusal_is_a_one_line_400_for_that_request_only(llm, images):
    port = images.server_port
    local = f"http://localhost:{port}"
    srv = running(llm, media=MediaPolicy(("localhost",), max_bytes=20_000, timeout=1.0))
    try:
        post = lambda body: httpx.post(f"{srv.base}/v1/chat/completions", json=body,  # noqa: E731
                                       timeout=120)
        cases = [
            ("http://example.com/a.png", "host 'example.com' is not in this server's "
                                         "--allowed-media-domains (localhost)"),
            (f"http://127.0.0.1:{port}/direct.png", "host '127.0.0.1' is not in"),
            (f"{local}/to-other.png", f"(redirected to http://127.0.0.1:{port}/other.png): "
                                      f"refused, host '127.0.0.1' is not in"),
            (f"{local}/big.png", "over this server's limit of 20000 bytes"),
            (f"{local}/endless.png", "over this server's limit of 20000 bytes"),
            (f"{local}/stall.png", "not fetched within 1 s (--media-fetch-timeout)"),
            (f"{local}/page.html", "its Content-Type is text/html, not an image"),
            (f"{local}/missing.png", "its server answered HTTP 404"),
            ("/etc/passwd", "no server file is read"),
            ("ftp://localhost/a.png", "data URLs"),
        ]
        for url, words in cases:
            r = post(chat_body(url))
            assert r.status_code == 400, (url, r.text)
            message = r.json()["error"]["message"]
            assert words in message and "\n" not in message, (url, message)
        # a host not allowed is never asked, neither directly nor after a redirect
        assert "/to-other.png" in images.state["hits"]
        assert not {"/direct.png", "/other.png"} & set(images.state["hits"])
        # the server goes on: the next request with an allowed URL is answered
        r = post(chat_body(f"{local}/a.png"))
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def test_without_allowed_domains_no_url_is_fetched(llm, images):
    srv = running(llm)
    try:
        r = httpx.post(f"{srv.base}/v1/chat/completions",
                       json=chat_body(f"http://localhost:{images.server_port}/a.png"),
                       timeout=120)
        assert r.status_code == 400
        assert "fetches no image URLs" in r.json()["error"]["message"]
        assert "--allowed-media-domains" in r.json()["error"]["message"]
        assert images.state["hits"] == []
    finally:
        srv.stop()


def test_a_slow_url_holds_no_parse_worker(llm, images):
    """With one parse worker, a request whose image URL does not answer yet leaves the server
    answering other requests; it is answered once the image arrives."""
    srv = running(llm, workers=1, media=MediaPolicy(("localhost",), timeout=60))
    slow = {}
    try:
        def ask_slow():
            slow["r"] = httpx.post(f"{srv.base}/v1/chat/completions", json=chat_body(
                f"http://localhost:{images.server_port}/slow.png"), timeout=120)

        thread = threading.Thread(target=ask_slow)
        thread.start()
        assert images.state["slow_started"].wait(60)
        r = httpx.post(f"{srv.base}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=20)
        assert r.status_code == 200, r.text
        assert "r" not in slow  # still waiting for its image
        images.state["release"].set()
        thread.join(120)
        assert slow["r"].status_code == 200, slow["r"].text
    finally:
        images.state["release"].set()
        srv.stop()


def test_more_images_than_the_limit_are_a_400_before_any_fetch(llm, images, monkeypatch):
    """The tower's per-prompt limit (LLM(limit_mm_per_prompt=...), tests/test_vision_tower.py)
    refuses a chat with more images, its URLs not fetched; one within it is answered."""
    monkeypatch.setattr(llm.vision, "max_images", 1)
    local = f"http://localhost:{images.server_port}"
    srv = running(llm, media=MediaPolicy(("localhost",), timeout=20))
    try:
        post = lambda body: httpx.post(f"{srv.base}/v1/chat/completions", json=body,  # noqa: E731
                                       timeout=120)
        r = post(chat_body(f"{local}/a.png", f"{local}/b.png"))
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            "the prompt holds 2 image(s), over the limit of 1 per prompt "
            "(limit_mm_per_prompt / --limit-mm-per-prompt)")
        assert images.state["hits"] == []
        r = post(chat_body(data_url(images.state["png"]["/a.png"]),
                           data_url(images.state["png"]["/b.png"])))
        assert r.status_code == 400 and "over the limit of 1" in r.text
        assert post(chat_body(f"{local}/a.png")).status_code == 200
    finally:
        srv.stop()


def test_allowed_domains_are_bare_host_names():
    assert parse_domains("Example.com, localhost,example.com") == ("example.com", "localhost")
    for bad in ("http://example.com", "example.com:80", "*.example.com", "a.com/x", ","):
        with pytest.raises(ValueError, match="must be a host name"):
            parse_domains(bad)
    assert MediaPolicy().allowed_domains == ()
    with pytest.raises(ValueError, match="timeout"):
        MediaPolicy(("localhost",), timeout=0)
    # hosts as the client parses them: userinfo is not the host, IDNA names match punycode
    policy = MediaPolicy("example.com,пример.рф")
    assert policy.allowed_domains == ("example.com", "xn--e1afmkfd.xn--p1ai")
    for ok in ("https://EXAMPLE.com:8443/a.png", "http://xn--e1afmkfd.xn--p1ai/a.png",
               "http://пример.рф/a.png"):
        policy.check(ok)
    for bad, words in (("http://example.com@evil.com/a.png", "host 'evil.com'"),
                       ("http://evil.com/?u=http://example.com", "host 'evil.com'"),
                       ("file:///etc/passwd", "only http(s)"), ("http:///a.png", "only http")):
        with pytest.raises(MediaError, match=re.escape(words)):
            policy.check(bad)
