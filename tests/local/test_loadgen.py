"""The load generator against a small OpenAI-completions server: concurrency follows the pattern, both
domains are sent, replicas share the load, failures are recorded (the real engines are in the fleet test)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable

import pytest
from aiohttp import web

from specserve_operator.local.loadgen import LoadGenerator, RequestRecord, window_tokens_per_s
from specserve_operator.local.traffic import parse_pattern


class CompletionsServer:
    def __init__(self, fail_prompt: str | None = None, delay: Callable[[], float] = lambda: 0.05) -> None:
        self.delay = delay
        self.in_flight = 0
        self.peaks: list[tuple[float, int]] = []
        self.prompts: Counter[str] = Counter()
        self.fail_prompt = fail_prompt

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prompts[body["prompt"]] += 1
        self.in_flight += 1
        self.peaks.append((asyncio.get_running_loop().time(), self.in_flight))
        try:
            await asyncio.sleep(self.delay())
        finally:
            self.in_flight -= 1
        if body["prompt"] == self.fail_prompt:
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response({"usage": {"completion_tokens": body["max_tokens"]}})


async def _serve(server: CompletionsServer, keep_alive_s: float = 75.0) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/completions", server.handle)
    runner = web.AppRunner(app, keepalive_timeout=keep_alive_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_concurrency_follows_the_pattern_across_replicas() -> None:
    servers = [CompletionsServer(), CompletionsServer()]
    runners, urls = zip(*[await _serve(s) for s in servers], strict=True)
    try:
        gen = LoadGenerator(
            endpoints={"a": urls[0], "b": urls[1]},
            model="m",
            prompts={"code": ["def f(", "class A:"], "prose": ["The sea"]},
            max_tokens=7,
        )
        pattern = parse_pattern("quiet:0.6:1:1,busy:0.8:6:0,quiet2:0.6:2:0.5")
        t0 = asyncio.get_running_loop().time()
        records = await gen.run("specserve", pattern)
    finally:
        for r in runners:
            await r.cleanup()
    assert records and all(r.ok and r.completion_tokens == 7 for r in records)
    by_phase = Counter(r.phase for r in records)
    assert set(by_phase) == {"quiet", "busy", "quiet2"}
    # quiet has one client: never two requests at once anywhere; busy's six are split over both replicas.
    quiet_peak = max(n for s in servers for t, n in s.peaks if t - t0 < 0.55)
    busy = [n for s in servers for t, n in s.peaks if 0.7 < t - t0 < 1.3]
    assert quiet_peak == 1
    assert max(busy) == 3
    assert {r.domain for r in records if r.phase == "quiet"} == {"code"}
    assert {r.domain for r in records if r.phase == "busy"} == {"prose"}
    assert Counter(r.replica for r in records if r.phase == "busy").keys() == {"a", "b"}
    assert gen.progress is not None and gen.progress.completed == len(records) and gen.progress.failed == 0
    assert all(r.end_s >= r.start_s for r in records)


async def test_failures_are_recorded() -> None:
    server = CompletionsServer(fail_prompt="bad")
    runner, url = await _serve(server)
    try:
        gen = LoadGenerator(endpoints={"a": url}, model="m", prompts={"code": ["bad"], "prose": ["ok"]})
        records = await gen.run("off", parse_pattern("p:0.4:2"))
    finally:
        await runner.cleanup()
    failed = [r for r in records if not r.ok]
    assert failed and all(r.domain == "code" and "HTTP 500" in (r.error or "") for r in failed)
    assert any(r.ok for r in records)
    assert gen.progress is not None and gen.progress.failed == len(failed)


async def test_a_run_can_go_to_other_endpoints() -> None:
    """The plain-decoding run sends the same traffic to the stock engines instead of the fleet's."""
    fleet, stock = CompletionsServer(), CompletionsServer()
    (fleet_runner, fleet_url), (stock_runner, stock_url) = await _serve(fleet), await _serve(stock)
    try:
        gen = LoadGenerator(endpoints={"a": fleet_url}, model="m", prompts={"code": ["x"], "prose": ["y"]})
        off = await gen.run("off", parse_pattern("p:0.3:2"), {"a": stock_url})
        static = await gen.run("static", parse_pattern("p:0.3:2"))
    finally:
        await fleet_runner.cleanup()
        await stock_runner.cleanup()
    assert off and static and all(r.ok and r.replica == "a" for r in off + static)
    assert sum(stock.prompts.values()) == len(off) and max(n for _, n in stock.peaks) == 2
    assert sum(fleet.prompts.values()) == len(static)


async def test_no_request_is_sent_on_a_connection_the_server_is_closing() -> None:
    """After a busy phase one client cycles through every pooled connection (aiohttp reuses the
    longest-idle first), so each idles for about as long as the server's keep-alive: without a client
    keep-alive below the server's, a request now and then goes out on a connection the server is closing
    (connection reset; seen in the fleet test, and here in three runs of four with the client's
    default). The server's keep-alive is scaled down to keep the test short."""
    rng = random.Random(1)
    server = CompletionsServer(delay=lambda: rng.uniform(0.01, 0.1))
    runner, url = await _serve(server, keep_alive_s=0.3)
    try:
        gen = LoadGenerator(
            endpoints={"a": url}, model="m", prompts={"code": ["x"], "prose": ["y"]}, idle_connection_s=0.15
        )
        records = await gen.run("specserve", parse_pattern(",".join(["busy:0.3:6:0,quiet:0.8:1:0"] * 12)))
    finally:
        await runner.cleanup()
    assert len(records) > 400
    assert [r.error for r in records if not r.ok] == []


def test_the_default_client_keep_alive_is_below_the_engines() -> None:
    from vllm import envs

    assert LoadGenerator.idle_connection_s < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE


def _request(start_s: float, end_s: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord("sweep", "r0", "code", "sweep", start_s, end_s, tokens, ok)


def test_a_window_counts_the_part_of_each_request_inside_it() -> None:
    # Requests that all outlast a short window still generated tokens in it: it must not read zero.
    assert window_tokens_per_s([_request(0.0, 4.0, 40), _request(0.0, 6.0, 48)], 0.0, 3.0) == (30 + 24) / 3
    # Inside: counted whole; failed: not at all; straddling either edge: the part inside.
    records = [
        _request(1.0, 2.0, 20),
        _request(1.5, 2.0, 10, ok=False),
        _request(0.0, 2.0, 30),
        _request(2.0, 5.0, 30),
    ]
    assert window_tokens_per_s(records, 1.0, 3.0) == pytest.approx((20 + 15 + 10) / 2)
