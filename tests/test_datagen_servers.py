"""`app.datagen.servers.ServerPool` in-process against real loopback servers (`ScriptedServer`): which
failures are retried and how often, the backoff between tries, which failures take a server out of the
rotation, the probe that brings it back, the outage that stops the requests, and the slots per server."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from app.datagen.servers import (
    AllServersDown,
    NoServerReachable,
    RequestFailed,
    ServerPool,
    _base_url,
    _describe,
    _snippet,
)
from tests.datagen_server import SCRIPTED_MODEL, ScriptedServer, free_port

SETTINGS = {"concurrency": 2, "max_retries": 2, "retry_backoff_s": 0.01, "probe_interval_s": 0.1}


def body(text: str) -> dict[str, Any]:
    return {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def with_pool(
    urls: list[str],
    work: Callable[[ServerPool], Awaitable[Any]],
    *,
    model: str | None = SCRIPTED_MODEL,
    timeout_s: float = 10.0,
    **settings: Any,
) -> tuple[Any, list[str]]:
    """`work(pool)` on a started pool of `urls`; (its result, the pool's log lines)."""
    lines: list[str] = []

    async def main() -> Any:
        # no kept-alive connections: a stopped ScriptedServer's handler threads would answer on them
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
            options = {**SETTINGS, "outage_timeout_s": 5.0, **settings}
            pool = ServerPool(urls, http, log=lines.append, **options)
            await pool.start(model)
            try:
                return await work(pool)
            finally:
                await pool.close()

    return asyncio.run(main()), lines


def test_urls_name_a_server_with_or_without_v1_and_details_are_one_short_line() -> None:
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert _base_url(url) == "http://h:1"
    assert _base_url("http://h:1/apiv1") == "http://h:1/apiv1"
    assert _base_url("http://BOX/") == "http://BOX" and _base_url("http://BOX/v1") == "http://BOX"
    assert _snippet(" a\n\tb  c ") == "a b c"
    assert _snippet("x" * 200) == "x" * 200
    assert _snippet("x" * 198 + "\n\n y") == "x" * 198 + " y"  # collapsed first, then measured
    assert _snippet("x" * 201) == "x" * 200 + "..."
    assert _describe(TimeoutError("read timed out")) == "read timed out"
    assert _describe(TimeoutError()) == "TimeoutError"


def test_the_backoff_doubles_from_retry_backoff_s_up_to_a_minute_with_jitter() -> None:
    pool = ServerPool(
        ["http://h:1"],
        None,  # type: ignore[arg-type]  # _backoff sends nothing
        concurrency=1,
        max_retries=9,
        retry_backoff_s=5.0,
        probe_interval_s=1.0,
        outage_timeout_s=1.0,
        log=print,
    )
    random.seed(11)
    waits = [pool._backoff(attempt) for attempt in range(1, 8)]
    random.seed(11)
    jitter = [random.uniform(0.5, 1.5) for _ in range(7)]
    bases = [5.0, 10.0, 20.0, 40.0, 60.0, 60.0, 60.0]
    assert waits == pytest.approx([base * factor for base, factor in zip(bases, jitter, strict=True)])
    random.seed(None)
    for attempt in (1, 3, 9):
        base = min(60.0, 5.0 * 2 ** (attempt - 1))
        samples = [pool._backoff(attempt) for _ in range(400)]
        assert 0.5 * base <= min(samples) < 0.6 * base and 1.4 * base < max(samples) <= 1.5 * base


def test_a_good_answer_is_returned_as_sent_and_resets_the_failure_streak(scripted: ScriptedServer) -> None:
    async def work(pool: ServerPool) -> Any:
        server = pool.servers[0]
        scripted.broken = True
        for _ in range(2):
            with pytest.raises(RequestFailed):
                await pool.chat(body("hello"))
        streak = server.consecutive_failures
        scripted.broken = False
        payload = await pool.chat(body("hello"))
        after = server.consecutive_failures
        scripted.broken = True
        for _ in range(2):
            with pytest.raises(RequestFailed):
                await pool.chat(body("hello"))
        return payload, streak, after, server

    (payload, streak, after, server), lines = with_pool([scripted.url], work, max_retries=0)
    assert payload["choices"][0]["message"]["content"].startswith("echo ")
    assert (streak, after) == (2, 0)
    # four failures in all, never three in a row: the server stays in the rotation
    assert server.alive and server.consecutive_failures == 2 and (server.requests, server.failures) == (5, 4)
    assert server.in_flight == 0 and server.peak_in_flight == 1 and lines == []


def test_a_5xx_is_retried_max_retries_times_with_the_backoff_between_tries(scripted: ScriptedServer) -> None:
    async def work(pool: ServerPool) -> Any:
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            await pool.chat(body("http500"))
        return str(failed.value), time.monotonic() - started, pool.servers[0]

    (message, elapsed, server), lines = with_pool([scripted.url], work, max_retries=2, retry_backoff_s=0.1)
    assert message == f"{scripted.url}: HTTP 500: Internal Server Error (gave up after 3 attempts)"
    assert len(scripted.requests) == 3 and (server.requests, server.failures) == (3, 3)
    assert 0.5 * (0.1 + 0.2) <= elapsed < 1.5 * (0.1 + 0.2) + 0.5  # two waits: 0.1 s and 0.2 s, jittered
    assert (
        not server.alive
        and server.consecutive_failures == 0
        and lines
        == [f"server {scripted.url} leaves the rotation: {scripted.url}: HTTP 500: Internal Server Error"]
    )


def test_the_first_try_does_not_wait(scripted: ScriptedServer) -> None:
    async def work(pool: ServerPool) -> float:
        started = time.monotonic()
        await pool.chat(body("hello"))
        return time.monotonic() - started

    elapsed, _ = with_pool([scripted.url], work, retry_backoff_s=4.0)
    assert elapsed < 1.0


def test_a_flaky_server_answers_on_a_later_try(scripted: ScriptedServer) -> None:
    async def work(pool: ServerPool) -> Any:
        return await pool.chat(body("flaky start")), pool.servers[0]

    (payload, server), _ = with_pool([scripted.url], work, max_retries=2)
    assert payload["choices"][0]["message"]["content"].startswith("echo ")
    assert (server.requests, server.failures, server.consecutive_failures) == (3, 2, 0) and server.alive


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bad400", 'HTTP 400: {"detail": "prompt is too long"}'),
        ("nonjson", "response is not JSON: '<html>502 Bad Gateway</html>'"),
        ("badgzip", "bad response (Error -3 while decompressing data: incorrect header check)"),
    ],
)
def test_an_answer_that_retrying_cannot_fix_fails_at_once(
    scripted: ScriptedServer, text: str, message: str
) -> None:
    async def work(pool: ServerPool) -> Any:
        with pytest.raises(RequestFailed) as failed:
            await pool.chat(body(text))
        return str(failed.value), pool.servers[0]

    (error, server), lines = with_pool([scripted.url], work, max_retries=3)
    assert error == f"{scripted.url}: {message}"
    assert len(scripted.requests) == 1 and server.failures == 0 and server.consecutive_failures == 0
    assert server.alive and server.in_flight == 0 and lines == []


def test_an_error_object_in_a_200_is_retried_but_a_body_with_choices_is_returned(
    scripted: ScriptedServer,
) -> None:
    """The pool judges no answer but an error object without `choices` (parse_completion does)."""

    async def work(pool: ServerPool) -> Any:
        with pytest.raises(RequestFailed) as failed:
            await pool.chat(body("errorbody"))
        return str(failed.value), await pool.chat(body("nochoices")), await pool.chat(body("warned"))

    (error, payload, warned), _ = with_pool([scripted.url], work, max_retries=1)
    assert error == (
        f'{scripted.url}: error in a 200 response: {{"message": "CUDA out of memory"}} (gave up after 2 attempts)'
    )
    assert payload == {"id": "x", "object": "chat.completion"}
    assert warned["error"] == {"message": "a warning"} and warned["choices"][0]["finish_reason"] == "stop"
    assert len(scripted.requests) == 4


def test_429_is_retried_without_counting_toward_leaving_the_rotation(scripted: ScriptedServer) -> None:
    async def work(pool: ServerPool) -> Any:
        with pytest.raises(RequestFailed) as failed:
            await pool.chat(body("busy"))
        return str(failed.value), pool.servers[0]

    (error, server), lines = with_pool([scripted.url], work, max_retries=4)
    assert error == f"{scripted.url}: HTTP 429 (busy) (gave up after 5 attempts)"
    assert (server.requests, server.failures, server.consecutive_failures) == (5, 5, 0)
    assert server.alive and lines == []


def test_a_timeout_is_retried_and_counts_but_leaves_the_server_in(tmp_path: Any) -> None:
    slow = ScriptedServer(delay_s=1.0).start()

    async def work(pool: ServerPool) -> Any:
        with pytest.raises(RequestFailed) as failed:
            await pool.chat(body("slow"))
        return str(failed.value), pool.servers[0]

    try:
        (error, server), lines = with_pool([slow.url], work, max_retries=1, timeout_s=0.1)
    finally:
        slow.stop()
    assert error == f"{slow.url}: timed out (ReadTimeout) (gave up after 2 attempts)"  # httpx's has no text
    assert server.alive and (server.failures, server.consecutive_failures) == (2, 2) and lines == []


def test_requests_failing_together_take_the_server_out_once(scripted: ScriptedServer) -> None:
    async def work(pool: ServerPool) -> Any:
        return await asyncio.gather(*(pool.chat(body("hangup")) for _ in range(2)), return_exceptions=True)

    (outcomes, lines) = with_pool([scripted.url], work, max_retries=0, probe_interval_s=5.0)
    assert [type(outcome) for outcome in outcomes] == [RequestFailed, RequestFailed]
    assert len(scripted.requests) == 2 and len(lines) == 1 and "leaves the rotation" in lines[0]


def test_a_dropped_connection_takes_the_server_out_at_once(scripted: ScriptedServer) -> None:
    text, cause = "hangup", "connection lost (Server disconnected without sending a response.)"

    async def work(pool: ServerPool) -> Any:
        with pytest.raises(AllServersDown) as failed:
            await pool.chat(body(text))
        return str(failed.value), pool.servers[0]

    (error, server), lines = with_pool(
        [scripted.url], work, max_retries=3, outage_timeout_s=0.3, probe_interval_s=5.0
    )
    assert error == f"no server reachable for 0 s: last error {scripted.url}: {cause}"
    assert len(scripted.requests) == 1 and not server.alive and server.failures == 1
    assert lines == [f"server {scripted.url} leaves the rotation: {scripted.url}: {cause}"]


def test_a_failed_try_moves_to_another_server_and_load_goes_to_the_least_used() -> None:
    broken, healthy = ScriptedServer().start(), ScriptedServer().start()
    broken.broken = True

    async def work(pool: ServerPool) -> Any:
        first = await pool.chat(body("hello"))
        broken.broken = False
        for index in range(4):
            await pool.chat(body(f"more {index}"))
        return first

    try:
        first, _ = with_pool([broken.url, healthy.url], work, max_retries=1)
    finally:
        broken.stop()
        healthy.stop()
    assert first["choices"][0]["message"]["content"].startswith("echo ")
    # the first try went to the first server, the retry to the other; then the fewest requests wins
    # (the first server on a tie)
    assert [m[0]["content"] for m in broken.requests] == ["hello", "more 0", "more 2"]
    assert [m[0]["content"] for m in healthy.requests] == ["hello", "more 1", "more 3"]


def test_a_retry_avoids_the_server_that_failed_even_when_it_is_the_least_busy() -> None:
    """The other server has a slow request in flight, the failing one none: the retry still goes to
    the other one."""
    slow, broken = ScriptedServer(delay_s=0.5).start(), ScriptedServer().start()
    broken.broken = True

    async def work(pool: ServerPool) -> Any:
        busy = asyncio.create_task(pool.chat(body("slow one")))
        await asyncio.sleep(0.1)
        answer = await pool.chat(body("hello"))
        await busy
        return answer

    try:
        answer, _ = with_pool([slow.url, broken.url], work, max_retries=1)
    finally:
        slow.stop()
        broken.stop()
    assert answer["choices"][0]["message"]["content"].startswith("echo ")
    assert [m[0]["content"] for m in broken.requests] == ["hello"]
    assert sorted(m[0]["content"] for m in slow.requests) == ["hello", "slow one"]


def test_concurrency_bounds_the_requests_in_flight_per_server() -> None:
    server = ScriptedServer(delay_s=0.1).start()

    async def work(pool: ServerPool) -> Any:
        started = time.monotonic()
        await asyncio.gather(*(pool.chat(body(f"q {i}")) for i in range(6)))
        return time.monotonic() - started, pool.servers[0]

    try:
        (elapsed, state), _ = with_pool([server.url], work, concurrency=2, probe_interval_s=5.0)
    finally:
        server.stop()
    assert server.peak_active == 2 and state.peak_in_flight == 2 and state.in_flight == 0
    assert 0.3 <= elapsed < 2.0  # three rounds of two; a freed slot wakes the next request at once


def test_an_outage_longer_than_outage_timeout_s_stops_the_requests() -> None:
    server = ScriptedServer().start()

    async def work(pool: ServerPool) -> Any:
        server.stop()
        started = time.monotonic()
        with pytest.raises(AllServersDown) as failed:
            await pool.chat(body("hello"))
        elapsed = time.monotonic() - started
        with pytest.raises(AllServersDown) as again:  # no try this time: refused at once, without a cause
            await pool.chat(body("hello"))
        return str(failed.value), elapsed, str(again.value), pool.servers[0]

    (error, elapsed, again, state), lines = with_pool(
        [server.url], work, max_retries=5, outage_timeout_s=0.6, probe_interval_s=10.0
    )
    assert (
        error
        == f"no server reachable for 1 s: last error {server.url}: cannot connect (All connection attempts failed)"
    )
    assert 0.6 <= elapsed < 2.0  # woken by the outage's end, not the 10 s probe interval
    assert again == "no server reachable for 1 s" and state.failures == 1 and state.requests == 1
    assert lines == [f"server {server.url} leaves the rotation: {error.split('last error ', 1)[1]}"]


def test_a_request_during_an_outage_waits_only_for_the_rest_of_it(scripted: ScriptedServer) -> None:
    async def work(pool: ServerPool) -> Any:
        with pytest.raises(RequestFailed):
            await pool.chat(body("hangup"))  # the only server leaves the rotation: the outage starts
        await asyncio.sleep(0.4)
        started = time.monotonic()
        with pytest.raises(AllServersDown) as failed:
            await pool.chat(body("hello"))
        return str(failed.value), time.monotonic() - started

    (error, elapsed), _ = with_pool(
        [scripted.url], work, max_retries=0, outage_timeout_s=0.7, probe_interval_s=10.0
    )
    assert error == "no server reachable for 1 s" and 0.15 <= elapsed < 0.6


def test_a_server_back_after_an_outage_rejoins_and_a_second_outage_is_timed_from_its_own_start() -> None:
    port = free_port()
    first, second, third = (ScriptedServer(port=port) for _ in range(3))
    first.start()

    async def work(pool: ServerPool) -> Any:
        first.stop()
        with pytest.raises(RequestFailed):
            await pool.chat(body("hello"))
        down = pool.servers[0].alive
        second.start()
        started = time.monotonic()
        payload = await pool.chat(body("hello"))
        waited = time.monotonic() - started
        await asyncio.sleep(1.0)  # longer than the outage timeout since the first outage began
        second.stop()
        with pytest.raises(RequestFailed):
            await pool.chat(body("hello"))
        started = time.monotonic()
        with pytest.raises(AllServersDown) as failed:
            await pool.chat(body("hello"))
        return down, waited, payload, time.monotonic() - started, str(failed.value)

    try:
        (down, waited, payload, outage, error), lines = with_pool(
            [first.url], work, max_retries=0, probe_interval_s=0.2, outage_timeout_s=1.0
        )
    finally:
        third.stop()
    assert not down and 0.0 < waited < 0.9 and payload["choices"][0]["message"]["content"].startswith("echo ")
    assert lines[1] == f"server {first.url} answers again; back in the rotation"
    assert len(lines) == 3 and lines[2].startswith(f"server {first.url} leaves the rotation")
    assert 0.9 < outage < 1.6 and error == "no server reachable for 1 s"


def test_closing_stops_the_probe_and_a_pool_never_started_closes_too(scripted: ScriptedServer) -> None:
    async def main() -> Any:
        async with httpx.AsyncClient() as http:
            options = {**SETTINGS, "outage_timeout_s": 1.0}
            idle = ServerPool([scripted.url], http, log=print, **options)
            await idle.close()
            pool = ServerPool([scripted.url], http, log=print, **options)
            await pool.start(None)
            prober = pool._prober
            await pool.close()
            return prober is not None and prober.done() and prober.cancelled()

    assert asyncio.run(main())


def test_start_settles_the_model_and_leaves_an_unreachable_server_out() -> None:
    live, dead = ScriptedServer().start(), f"http://127.0.0.1:{free_port()}"
    live.models = [{"id": "first"}, {"id": "second"}, {"object": "model"}, "junk", {"id": 7}]

    async def listed(pool: ServerPool) -> Any:
        return [(s.url, s.alive) for s in pool.servers], await pool._list_models(pool.servers[0])

    try:
        (states, ids), lines = with_pool([f"{live.url}/v1/", dead], listed, model="second")
        (_, ids_again), _ = with_pool([live.url], listed, model=None)
        other = ScriptedServer().start()
        other.models = [{"id": "other"}]
        with pytest.raises(NoServerReachable) as refused:
            with_pool([live.url, other.url], listed, model="third")
    finally:
        live.stop()
        other.stop()
    assert str(refused.value) == (
        f"datagen.model: 'third' is not served by every server: {live.url} serves ['first', 'second']; "
        f"{other.url} serves ['other']"
    )
    assert states == [(live.url, True), (dead, False)] and ids == ids_again == ["first", "second"]
    assert lines == [f"server {dead} is unreachable; it joins the rotation when it answers"]


@pytest.mark.parametrize(
    ("models", "status", "refusal"),
    [
        ([], 200, r"datagen.model: not set and http://127.0.0.1:\d+/v1/models lists no model"),
        (
            {"id": "x"},
            200,
            r"no server reachable at http://127.0.0.1:\d+, http://127.0.0.1:\d+ \(GET /v1/models failed\); start the inference server or fix datagen.servers$",
        ),
        ([{"id": "x"}], 503, r"no server reachable at http://127.0.0.1:\d+, http://127.0.0.1:\d+ \(GET"),
    ],
)
def test_start_refuses_servers_that_list_no_model_or_answer_badly(
    scripted: ScriptedServer, models: Any, status: int, refusal: str
) -> None:
    scripted.models, scripted.models_status = models, status
    urls = [scripted.url, f"http://127.0.0.1:{free_port()}"]
    with pytest.raises(NoServerReachable, match=refusal):
        with_pool(urls, lambda pool: asyncio.sleep(0), model=None)
