"""Fixtures for the controller tests: synthetic fleet measurements and specs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from specserve_engine import metric_names
from specserve_operator.api.models import SpeculativeServingSpec
from specserve_operator.tuner import observations


@dataclass(frozen=True)
class BucketLoad:
    """What one pod did in one bucket over the window."""

    batch: float
    steps_plain: float = 0.0
    step_s_plain: float = 0.0
    steps_spec: float = 0.0
    step_s_spec: float = 0.0
    k: int = 0


def pod_rows(
    namespace: str,
    pod: str,
    drafter: str,
    loads: dict[str, BucketLoad],
    alphas: tuple[float, ...] = (0.8,) * 8,
    policy_version: int = 1,
    running: float | None = None,
) -> list[observations.Row]:
    """The rows the reader would return for one pod with these loads and this conditional acceptance."""
    base = {"namespace": namespace, "pod": pod}
    rows: list[observations.Row] = [
        (
            observations.POLICY_INFO,
            {**base, "drafter": drafter, "mode": "on", "policy_version": str(policy_version)},
            1.0,
        )
    ]
    if running is not None:
        rows.append((observations.RUNNING, base, running))
    accepted_pos: dict[int, float] = {}
    proposed_pos: dict[int, float] = {}
    for label, load in loads.items():
        if load.steps_plain:
            lab = {**base, "bucket": label, "speculating": "false"}
            rows += [
                (observations.STEPS, lab, load.steps_plain),
                (observations.STEP_SECONDS, lab, load.steps_plain * load.step_s_plain),
                (observations.TOKENS, lab, load.steps_plain * load.batch),
            ]
        if load.steps_spec:
            survival, surv = [], 1.0
            for i in range(load.k):
                surv *= alphas[i]
                survival.append(surv)
            drafts = load.steps_spec * load.batch
            lab = {**base, "bucket": label, "speculating": "true"}
            rows += [
                (observations.STEPS, lab, load.steps_spec),
                (observations.STEP_SECONDS, lab, load.steps_spec * load.step_s_spec),
                (observations.TOKENS, lab, drafts * (1 + sum(survival))),
            ]
            slab = {**base, "bucket": label, "drafter": drafter}
            rows += [
                (observations.DRAFTS, slab, drafts),
                (observations.DRAFT_TOKENS, slab, drafts * load.k),
                (observations.ACCEPTED, slab, drafts * sum(survival)),
            ]
            for i, s in enumerate(survival):
                accepted_pos[i] = accepted_pos.get(i, 0.0) + drafts * s
                proposed_pos[i] = proposed_pos.get(i, 0.0) + drafts
    for i in sorted(proposed_pos):
        plab = {**base, "drafter": drafter, "position": str(i)}
        rows += [
            (observations.ACCEPTED_POS, plab, accepted_pos[i]),
            (observations.PROPOSED_POS, plab, proposed_pos[i]),
        ]
    return rows


# Row kind → (metric series, label names kept) for writing rows as Prometheus counters.
SERIES: dict[str, tuple[str, tuple[str, ...]]] = {
    observations.STEPS: (metric_names.ENGINE_STEPS.series[0], ("bucket", "speculating")),
    observations.STEP_SECONDS: (metric_names.ENGINE_STEP_SECONDS.series[0], ("bucket", "speculating")),
    observations.TOKENS: (metric_names.ENGINE_GENERATED_TOKENS.series[0], ("bucket", "speculating")),
    observations.DRAFTS: (metric_names.SPEC_DRAFTS.series[0], ("bucket", "drafter")),
    observations.DRAFT_TOKENS: (metric_names.SPEC_DRAFT_TOKENS.series[0], ("bucket", "drafter")),
    observations.ACCEPTED: (metric_names.SPEC_ACCEPTED_TOKENS.series[0], ("bucket", "drafter")),
    observations.ACCEPTED_POS: (
        metric_names.SPEC_ACCEPTED_TOKENS_PER_POSITION.series[0],
        ("drafter", "position"),
    ),
    observations.PROPOSED_POS: (
        metric_names.SPEC_DRAFT_TOKENS_PER_POSITION.series[0],
        ("drafter", "position"),
    ),
}


def openmetrics(rows: list[observations.Row], start_s: float, end_s: float, step_s: float = 15.0) -> str:
    """Rows as counters rising linearly from 0 at `start_s` to their value at `end_s` (the increase over
    that span is the row's value), gauges held constant; OpenMetrics text for promtool's backfill."""
    families: dict[str, list[str]] = {}
    types: dict[str, str] = {}
    n = int((end_s - start_s) // step_s)
    for kind, labels, value in rows:
        extra = {}
        if kind in SERIES:
            series, keep = SERIES[kind]
            family, mtype = series.removesuffix("_total"), "counter"
            extra = {k: labels[k] for k in keep if k in labels}
        elif kind == observations.POLICY_INFO:
            series = family = metric_names.SIDECAR_POLICY_INFO.name
            mtype = "gauge"
            extra = {k: labels[k] for k in ("drafter", "mode", "policy_version")}
        elif kind == observations.RUNNING:
            series = family = metric_names.VLLM_REQUESTS_RUNNING
            mtype = "gauge"
        else:
            continue
        types[family] = mtype
        lab = {"namespace": labels["namespace"], "pod": labels["pod"], **extra}
        text = ",".join(f'{k}="{v}"' for k, v in sorted(lab.items()))
        lines = families.setdefault(family, [])
        for i in range(n + 1):
            t = start_s + i * step_s
            v = value * i / n if mtype == "counter" else value
            lines.append(f"{series}{{{text}}} {v:.6f} {t:.3f}")
    out = []
    for family, lines in families.items():
        out.append(f"# TYPE {family} {types[family]}")
        # OpenMetrics wants each series' samples in time order; group them by series.
        out.extend(sorted(lines, key=lambda line: (line.rsplit(" ", 2)[0], float(line.rsplit(" ", 1)[1]))))
    out.append("# EOF")
    return "\n".join(out) + "\n"


def spec_body(**overrides: object) -> dict:
    """The controller tests' resource spec as plain data; `section=value` replaces a section,
    `section__field=value` one field of it."""
    body: dict = {
        "replicas": 2,
        "model": {"name": "llama-3.1-8b-instruct", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
        "engine": {"image": "engine:test", "gpu": {"count": 1, "product": "NVIDIA-H100"}},
        "drafters": [
            {
                "name": "draft",
                "method": "draftModel",
                "source": "hf://meta-llama/Llama-3.2-1B-Instruct",
                "maxSpeculativeTokens": 4,
                "placement": "sidecar",
            },
            {"name": "ngram", "method": "ngram", "maxSpeculativeTokens": 4, "placement": "sidecar"},
        ],
        "speculation": {"evaluationInterval": "30s", "cooldown": "5m"},
    }
    for key, value in overrides.items():
        section, _, field = key.partition("__")
        if field:
            body[section][field] = value
        else:
            body[section] = value
    return body


def make_spec(**overrides: object) -> SpeculativeServingSpec:
    return SpeculativeServingSpec.model_validate(spec_body(**overrides))


@pytest.fixture
def rows_for() -> Callable[..., list[observations.Row]]:
    return pod_rows


@pytest.fixture
def spec_factory() -> Callable[..., SpeculativeServingSpec]:
    return make_spec


@pytest.fixture
def spec_body_factory() -> Callable[..., dict]:
    return spec_body


@pytest.fixture
def openmetrics_of() -> Callable[..., str]:
    return openmetrics


@pytest.fixture
def bucket_load() -> type[BucketLoad]:
    return BucketLoad


class SidecarStandIn:
    """A real HTTP server speaking the sidecar control API (GET /v1/state, PUT /v1/policy) with the
    sidecar's version rules: a bearer token, 409 for an older policyVersion, the same one a no-op."""

    def __init__(self, token: str | None = "secret-token") -> None:
        self.token = token
        self.policy = {"policyVersion": 0, "drafter": "draft", "mode": "on", "kByBucket": {}}
        self.puts: list[dict] = []
        self.runner = None
        self.url = ""

    def _state(self) -> dict:
        return {
            **self.policy,
            "drafters": [],
            "warm": True,
            "engineReachable": True,
        }

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> SidecarStandIn:
        from aiohttp import web

        async def state(request: web.Request) -> web.Response:
            return self._check(request) or web.json_response(self._state())

        async def put(request: web.Request) -> web.Response:
            refused = self._check(request)
            if refused is not None:
                return refused
            body = await request.json()
            if body["policyVersion"] < self.policy["policyVersion"]:
                return web.json_response(
                    {"error": "older policyVersion", "field": "policyVersion"}, status=409
                )
            self.puts.append(body)
            self.policy = body
            return web.json_response(self._state())

        app = web.Application()
        app.router.add_get("/v1/state", state)
        app.router.add_put("/v1/policy", put)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
        self.url = f"http://{bound[0]}:{bound[1]}"
        return self

    def _check(self, request):
        from aiohttp import web

        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": "unauthorized"}, status=401)
        return None

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def sidecars():
    started: list[SidecarStandIn] = []

    async def start(
        host: str = "127.0.0.1", port: int = 0, token: str | None = "secret-token"
    ) -> SidecarStandIn:
        s = await SidecarStandIn(token).start(host, port)
        started.append(s)
        return s

    yield start
    for s in started:
        await s.stop()
