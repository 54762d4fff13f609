"""Images and videos given by http(s) URL to the server: fetched only from the hosts its
operator allows (``hybridrt serve --allowed-media-domains``, vLLM's name), within a size and a
time limit, a redirect followed only to an allowed host. ``MediaPolicy.fetch_all`` is a
coroutine (httpx): the server awaits it on its event loop, outside the parse pool and the
engine, so a slow URL holds neither a parse worker nor other requests. Every refusal is a
one-line ``MediaError``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urljoin

MAX_REDIRECTS = 5
# Content-Types a fetched image or video may come with (none given: the bytes decide)
_MEDIA_TYPES = ("image/", "video/", "application/octet-stream", "binary/octet-stream")


class MediaError(ValueError):
    """A URL the policy refuses, or a fetch that failed: the request's own 400."""


def is_http_url(value) -> bool:
    return isinstance(value, str) and value[:8].lower().startswith(("http://", "https://"))


def parse_domains(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"example.com,localhost"`` (or a list of names) -> the host names, lower case (a
    non-ASCII name in punycode, as URLs are matched); ValueError for a name that is not a bare
    host (a scheme, a path, a port, a blank)."""
    if text is None:
        return ()
    names = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for name in names:
        host = name.strip().lower()
        if not host or any(c in host for c in "/:@ ?#*"):
            raise ValueError(f"allowed media domain {name.strip()!r} must be a host name such "
                             f"as example.com (no scheme, port, path or wildcard)")
        try:
            out.append(host.encode("idna").decode("ascii"))
        except UnicodeError:
            raise ValueError(f"allowed media domain {name.strip()!r} is not a valid host "
                             f"name") from None
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class MediaPolicy:
    """What the server may fetch: ``allowed_domains`` (exact host names, as vLLM matches them;
    empty: no URL is fetched), at most ``max_bytes`` for one request's images together, each
    image within ``timeout`` seconds (connecting, redirects and the body together)."""

    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = 20 << 20
    timeout: float = 10.0

    def __post_init__(self):
        object.__setattr__(self, "allowed_domains", parse_domains(self.allowed_domains))
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1:
            raise ValueError(f"media max_bytes must be a positive integer, got "
                             f"{self.max_bytes!r}")
        if not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ValueError(f"media fetch timeout must be a positive number of seconds, got "
                             f"{self.timeout!r}")

    def check(self, url: str) -> None:
        """MediaError unless ``url`` is http(s) on an allowed host."""
        reason = self._refusal(url)
        if reason is not None:
            raise MediaError(f"{_short(url)}: refused, {reason}")

    def _refusal(self, url: str) -> str | None:
        if not self.allowed_domains:
            return ("this server fetches no image URLs (its operator allows no domain: "
                    "--allowed-media-domains); send the image as a data URL "
                    "(data:image/png;base64,...)")
        import httpx

        try:  # the host as the client connects to it (its own parser), in ASCII (punycode)
            parsed = httpx.URL(url)
            host = parsed.raw_host.decode("ascii").lower()
        except (httpx.InvalidURL, ValueError):
            return "not a valid URL"
        if parsed.scheme not in ("http", "https") or not host:
            return "only http(s) URLs are fetched"
        if host not in self.allowed_domains:
            return (f"host {host!r} is not in this server's --allowed-media-domains "
                    f"({', '.join(self.allowed_domains)})")
        return None

    async def fetch_all(self, urls: Sequence[str]) -> dict[str, bytes]:
        """Every URL's body, fetched at once -> {url: bytes}, at most ``max_bytes`` in all;
        the first refusal or failure raises its MediaError (the other fetches cancelled)."""
        import httpx

        unique, budget = list(dict.fromkeys(urls)), [self.max_bytes]
        async with httpx.AsyncClient(follow_redirects=False, timeout=self.timeout) as client:
            tasks = [asyncio.ensure_future(self._fetch(client, u, budget)) for u in unique]
            try:
                bodies = await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
        return dict(zip(unique, bodies))

    async def _fetch(self, client, url: str, budget: list[int]) -> bytes:
        import httpx

        at = _short(url)
        try:
            return await asyncio.wait_for(self._follow(client, url, at, budget), self.timeout)
        except asyncio.TimeoutError:
            raise MediaError(f"{at}: not fetched within {self.timeout:g} s "
                             f"(--media-fetch-timeout)") from None
        except httpx.HTTPError as e:
            why = " ".join(str(e).split()) or type(e).__name__
            raise MediaError(f"{at}: could not be fetched ({why})") from None

    async def _follow(self, client, url: str, at: str, budget: list[int]) -> bytes:
        """GET ``url``, following redirects while each leads to an allowed host."""
        first = url
        for _ in range(MAX_REDIRECTS + 1):
            reason = self._refusal(url)
            if reason is not None:
                via = "" if url == first else f" (redirected to {url[:100]})"
                raise MediaError(f"{at}{via}: refused, {reason}")
            async with client.stream("GET", url) as r:
                if r.is_redirect and "location" in r.headers:
                    url = urljoin(url, r.headers["location"])
                    continue
                return await self._body(r, at, budget)
        raise MediaError(f"{at}: refused, more than {MAX_REDIRECTS} redirects")

    async def _body(self, r, at: str, budget: list[int]) -> bytes:
        """The answer's body, counted against ``budget`` (the bytes the request may still
        fetch)."""
        if r.status_code != 200:
            raise MediaError(f"{at}: its server answered HTTP {r.status_code}")
        kind = r.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind and not kind.startswith(_MEDIA_TYPES):
            raise MediaError(f"{at}: refused, its Content-Type is {kind}, not an image or a "
                             f"video")
        too_big = MediaError(f"{at}: refused, over this server's limit of {self.max_bytes} "
                             f"bytes for a request's fetched images (--media-max-bytes)")
        length = r.headers.get("content-length", "")
        if length.isdigit() and int(length) > budget[0]:
            raise too_big
        chunks = []
        async for chunk in r.aiter_bytes():
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)


def _short(url: str) -> str:
    """The URL as errors name it: at most 100 characters."""
    return f"image URL {url if len(url) <= 100 else url[:97] + '...'}"
