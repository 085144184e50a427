"""A pool of OpenAI-compatible servers: bounded concurrency each, retries, and a rotation of live ones.

Every request takes a slot on the live server with the fewest requests in flight (at most
`concurrency` per server). Transient failures (5xx, 429, timeouts, dropped connections, an error
object in a 200 body) are retried with exponential backoff and jitter, on another server when one
is free. A server that refuses connections, or fails `DEAD_AFTER` times in a row, leaves the
rotation; a background task probes it (GET /v1/models) and brings it back when it answers. When no
server has been alive for `outage_timeout_s`, requests stop with `AllServersDown`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from app.errors import UserError

DEAD_AFTER = 3
"""Consecutive transient failures after which a server leaves the rotation."""

MAX_BACKOFF_S = 60.0
PROBE_TIMEOUT_S = 10.0
DETAIL_CHARS = 200


class NoServerReachable(UserError):
    """No configured server answered at start, or none serves the requested model."""


class RequestFailed(Exception):
    """A request that will not succeed by retrying (4xx, or retries exhausted); the message says why."""


class AllServersDown(RequestFailed):
    """Every server has been out of the rotation for longer than the outage timeout."""


class _Transient(Exception):
    """A failure worth retrying. `dead` marks failures that say the server itself is gone."""

    def __init__(self, reason: str, dead: bool = False, counts: bool = True) -> None:
        super().__init__(reason)
        self.dead = dead
        self.counts = counts


@dataclass
class Server:
    """One server's place in the rotation, plus what it has done (for the final report)."""

    url: str
    alive: bool = True
    in_flight: int = 0
    peak_in_flight: int = 0
    consecutive_failures: int = 0
    requests: int = 0
    failures: int = 0


class ServerPool:
    """Sends chat-completion requests to the live servers; see the module docstring."""

    def __init__(
        self,
        urls: list[str],
        http: httpx.AsyncClient,
        *,
        concurrency: int,
        max_retries: int,
        retry_backoff_s: float,
        probe_interval_s: float,
        outage_timeout_s: float,
        log: Callable[[str], None],
    ) -> None:
        self.servers = [Server(_base_url(url)) for url in urls]
        self.http = http
        self.concurrency = concurrency
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.probe_interval_s = probe_interval_s
        self.outage_timeout_s = outage_timeout_s
        self.log = log
        self._changed = asyncio.Condition()
        self._all_down_since: float | None = None
        self._prober: asyncio.Task[None] | None = None

    async def start(self, model: str | None) -> str:
        """Probe every server, drop the unreachable ones, and settle the model id (given or listed)."""
        listed = await asyncio.gather(*(self._list_models(server) for server in self.servers))
        reachable = [
            (server, ids) for server, ids in zip(self.servers, listed, strict=True) if ids is not None
        ]
        if not reachable:
            urls = ", ".join(server.url for server in self.servers)
            raise NoServerReachable(
                f"datagen.servers: no server reachable at {urls} (GET /v1/models failed); "
                "start the inference server or fix datagen.servers"
            )
        if model is None:
            first_ids = next((ids for _, ids in reachable if ids), None)
            if not first_ids:
                raise NoServerReachable(
                    f"datagen.model: not set and {reachable[0][0].url}/v1/models lists no model; set datagen.model"
                )
            model = first_ids[0]
        wrong = [f"{server.url} serves {ids}" for server, ids in reachable if ids and model not in ids]
        if wrong:
            raise NoServerReachable(
                f"datagen.model: {model!r} is not served by every server: {'; '.join(wrong)}"
            )
        for server, ids in zip(self.servers, listed, strict=True):
            if ids is None:
                server.alive = False
                self.log(f"server {server.url} is unreachable; it joins the rotation when it answers")
        self._prober = asyncio.create_task(self._probe_dead_servers())
        return model

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            await asyncio.gather(self._prober, return_exceptions=True)

    async def chat(self, body: dict[str, Any]) -> Any:
        """POST body to /v1/chat/completions with retries; the decoded JSON of the first good answer."""
        last_error: _Transient | None = None
        last_server: Server | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt))
            server = await self._acquire(avoid=last_server, last_error=last_error)
            try:
                payload = await self._post(server, body)
            except _Transient as error:
                last_error, last_server = error, server
                await self._note_failure(server, error)
                continue
            finally:
                await self._release(server)
            server.consecutive_failures = 0
            return payload
        raise RequestFailed(f"{last_error} (gave up after {self.max_retries + 1} attempts)")

    async def _post(self, server: Server, body: dict[str, Any]) -> Any:
        server.requests += 1
        try:
            response = await self.http.post(f"{server.url}/v1/chat/completions", json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout) as error:
            raise _Transient(f"{server.url}: cannot connect ({_describe(error)})", dead=True) from None
        except httpx.TimeoutException as error:
            raise _Transient(f"{server.url}: timed out ({_describe(error)})") from None
        except httpx.TransportError as error:
            # the connection dropped mid-request: the server died or restarted
            raise _Transient(f"{server.url}: connection lost ({_describe(error)})", dead=True) from None
        except httpx.HTTPError as error:  # an undecodable body, a redirect loop: the answer is unusable
            raise RequestFailed(f"{server.url}: bad response ({_describe(error)})") from None
        status = response.status_code
        if status == 429:
            raise _Transient(f"{server.url}: HTTP 429 (busy)", counts=False)
        if status >= 500:
            raise _Transient(f"{server.url}: HTTP {status}: {_snippet(response.text)}")
        if status >= 400:
            raise RequestFailed(f"{server.url}: HTTP {status}: {_snippet(response.text)}")
        try:
            payload = response.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RequestFailed(f"{server.url}: response is not JSON: {_snippet(response.text)!r}") from None
        if isinstance(payload, dict) and "error" in payload and "choices" not in payload:
            raise _Transient(
                f"{server.url}: error in a 200 response: {_snippet(json.dumps(payload['error']))}"
            )
        return payload

    async def _acquire(self, avoid: Server | None, last_error: _Transient | None) -> Server:
        """A slot on the least busy live server (another than `avoid` when one is free)."""
        async with self._changed:
            while True:
                alive = [server for server in self.servers if server.alive]
                free = [server for server in alive if server.in_flight < self.concurrency]
                if free:
                    preferred = [server for server in free if server is not avoid] or free
                    server = min(preferred, key=lambda s: (s.in_flight, s.requests))
                    server.in_flight += 1
                    server.peak_in_flight = max(server.peak_in_flight, server.in_flight)
                    return server
                wait_s = self.probe_interval_s
                if not alive:
                    down_for = time.monotonic() - (self._all_down_since or time.monotonic())
                    if down_for >= self.outage_timeout_s:
                        cause = f": last error {last_error}" if last_error else ""
                        raise AllServersDown(f"no server reachable for {down_for:.0f} s{cause}")
                    wait_s = min(wait_s, self.outage_timeout_s - down_for)
                with contextlib.suppress(TimeoutError):  # woken by a release, a revival, or the clock
                    await asyncio.wait_for(self._changed.wait(), timeout=wait_s)

    async def _release(self, server: Server) -> None:
        async with self._changed:
            server.in_flight -= 1
            self._changed.notify_all()

    async def _note_failure(self, server: Server, error: _Transient) -> None:
        server.failures += 1
        if error.counts:
            server.consecutive_failures += 1
        if server.alive and (error.dead or server.consecutive_failures >= DEAD_AFTER):
            await self._set_alive(server, False, f"server {server.url} leaves the rotation: {error}")

    async def _set_alive(self, server: Server, alive: bool, message: str) -> None:
        async with self._changed:
            server.alive = alive
            server.consecutive_failures = 0
            any_alive = any(s.alive for s in self.servers)
            if not any_alive and self._all_down_since is None:
                self._all_down_since = time.monotonic()
            elif any_alive:
                self._all_down_since = None
            self._changed.notify_all()
        self.log(message)

    async def _probe_dead_servers(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            dead = [server for server in self.servers if not server.alive]
            answers = await asyncio.gather(*(self._list_models(server) for server in dead))
            for server, ids in zip(dead, answers, strict=True):
                if ids is not None:
                    await self._set_alive(
                        server, True, f"server {server.url} answers again; back in the rotation"
                    )

    async def _list_models(self, server: Server) -> list[str] | None:
        """Model ids from GET /v1/models; None when the server does not answer it properly."""
        try:
            response = await self.http.get(f"{server.url}/v1/models", timeout=PROBE_TIMEOUT_S)
            data = response.json().get("data") if response.status_code == 200 else None
        except (httpx.HTTPError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return None
        if not isinstance(data, list):
            return None
        return [entry["id"] for entry in data if isinstance(entry, dict) and isinstance(entry.get("id"), str)]

    def _backoff(self, attempt: int) -> float:
        return min(MAX_BACKOFF_S, self.retry_backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)


def _base_url(url: str) -> str:
    """`http://host:30000/`, `.../v1` and `.../v1/` all name the same server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _snippet(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS] + "..."


def _describe(error: Exception) -> str:
    return str(error) or type(error).__name__
