"""The built-in load generator: closed-loop clients sending OpenAI `/v1/completions` over HTTP, as many
at a time as the traffic pattern's phase asks for, each request drawn from the code-like or prose-like
domain and sent to the replica with the fewest requests in flight (a least-outstanding router)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from specserve_operator.local.traffic import TrafficPattern

CODE = "code"
PROSE = "prose"
DOMAINS = (CODE, PROSE)


@dataclass(frozen=True)
class RequestRecord:
    run: str  # which run of the session: "specserve", "off", "static"
    replica: str
    domain: str
    phase: str
    start_s: float  # from the start of the run
    end_s: float
    completion_tokens: int
    ok: bool
    error: str | None = None


def window_tokens_per_s(records: Sequence[RequestRecord], start_s: float, end_s: float) -> float:
    """Tokens per second generated in [start_s, end_s): each successful request's tokens spread evenly
    over its own span and counted for the part inside the window. Counting only the requests that finished
    inside credits a whole request to the window it ends in: after a busy phase, the requests still in
    flight land in the next phase, whose tokens/s then depends on its length (comparison runs are
    shorter), and a window shorter than every request reads zero."""
    tokens = 0.0
    for r in records:
        inside = min(r.end_s, end_s) - max(r.start_s, start_s)
        if r.ok and r.completion_tokens > 0 and inside > 0:
            tokens += r.completion_tokens * inside / (r.end_s - r.start_s)
    return tokens / (end_s - start_s)


@dataclass
class LoadProgress:
    run: str
    elapsed_s: float = 0.0
    total_s: float = 0.0
    phase: str = ""
    concurrency: int = 0
    in_flight: int = 0
    completed: int = 0
    failed: int = 0
    tokens: int = 0


@dataclass
class LoadGenerator:
    endpoints: Mapping[str, str]  # replica name -> engine base URL (http://127.0.0.1:PORT)
    model: str
    prompts: Mapping[str, Sequence[str]]  # domain -> prompts
    max_tokens: int = 64
    request_timeout_s: float = 120.0
    # Reuse a pooled connection only if it idled less than this: below the engine's own keep-alive
    # (vLLM's uvicorn closes idle connections after 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE). aiohttp hands
    # out the longest-idle connection first, so after a busy phase one client cycles through every
    # pooled connection and can send on one the engine is closing at that moment (a failed request).
    idle_connection_s: float = 2.0
    seed: int = 0
    records: list[RequestRecord] = field(default_factory=list)
    progress: LoadProgress | None = None
    _outstanding: dict[str, int] = field(default_factory=dict)
    _run_endpoints: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("endpoints: the load generator needs at least one replica")
        for domain in DOMAINS:
            if not self.prompts.get(domain):
                raise ValueError(f"prompts[{domain!r}]: no prompts for this traffic domain")

    async def run(
        self, label: str, pattern: TrafficPattern, endpoints: Mapping[str, str] | None = None
    ) -> list[RequestRecord]:
        """Send the pattern's traffic, to `endpoints` for this run if given (else the fleet's); returns
        this run's records once every request has finished."""
        self._run_endpoints = dict(endpoints or self.endpoints)
        self._outstanding = dict.fromkeys(self._run_endpoints, 0)
        self.progress = LoadProgress(run=label, total_s=pattern.total_s)
        loop = asyncio.get_running_loop()
        start = loop.time()
        run_records: list[RequestRecord] = []
        rng = random.Random(f"{self.seed}:{label}")
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self.idle_connection_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def client(index: int) -> None:
                while True:
                    now = loop.time() - start
                    at = pattern.phase_at(now)
                    if at is None:
                        return
                    if index >= at.phase.concurrency:
                        # Idle in this phase: wake at the next phase, or soon, to stay responsive.
                        await asyncio.sleep(min(0.25, max(0.01, at.end_s - now)))
                        continue
                    domain = CODE if rng.random() < at.phase.code_fraction else PROSE
                    prompt = rng.choice(list(self.prompts[domain]))
                    record = await self._one(session, label, at.phase.name, domain, prompt, start)
                    run_records.append(record)
                    self.records.append(record)

            async def track() -> None:
                assert self.progress is not None
                while True:
                    now = loop.time() - start
                    at = pattern.phase_at(now)
                    self.progress.elapsed_s = min(now, pattern.total_s)
                    self.progress.phase = at.phase.name if at else "draining"
                    self.progress.concurrency = at.phase.concurrency if at else 0
                    await asyncio.sleep(0.2)

            tracker = asyncio.create_task(track())
            try:
                await asyncio.gather(*(client(i) for i in range(pattern.max_concurrency)))
            finally:
                tracker.cancel()
        self.progress.elapsed_s = pattern.total_s
        self.progress.phase = "done"
        return run_records

    def _pick_replica(self) -> str:
        return min(self._outstanding, key=lambda name: self._outstanding[name])

    async def _one(
        self, session: aiohttp.ClientSession, label: str, phase: str, domain: str, prompt: str, start: float
    ) -> RequestRecord:
        assert self.progress is not None
        loop = asyncio.get_running_loop()
        replica = self._pick_replica()
        self._outstanding[replica] += 1
        self.progress.in_flight += 1
        t0 = loop.time() - start
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0}
        tokens, ok, error = 0, False, None
        try:
            async with session.post(f"{self._run_endpoints[replica]}/v1/completions", json=body) as resp:
                data = await resp.json(content_type=None)
                if resp.status == 200:
                    tokens = int(data["usage"]["completion_tokens"])
                    ok = True
                else:
                    error = f"HTTP {resp.status}: {str(data)[:200]}"
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            error = repr(exc)[:200]
        finally:
            self._outstanding[replica] -= 1
            self.progress.in_flight -= 1
        self.progress.completed += ok
        self.progress.failed += not ok
        self.progress.tokens += tokens
        return RequestRecord(label, replica, domain, phase, t0, loop.time() - start, tokens, ok, error)
