"""Fixtures for the controller tests: synthetic fleet measurements, specs, and real sidecars."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from specserve_engine import metric_names
from specserve_engine.api import SidecarConfig
from specserve_engine.control_api import build_app
from specserve_engine.sidecar_service import SidecarService
from specserve_operator.api.models import SpeculativeServingSpec
from specserve_operator.render import children as render
from specserve_operator.tuner import observations
from specserve_testing.prometheus import openmetrics


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
            # As the engine plugin labels them: the drafter in force and the K the steps verified.
            lab = {**base, "bucket": label, "speculating": "true", "drafter": drafter, "k": str(load.k)}
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


def ngram_sidecar_config(
    spec: SpeculativeServingSpec, runtime_dir: Path, host: str = "127.0.0.1", port: int = 0
) -> SidecarConfig:
    """The sidecar configuration the operator renders for `spec`, with each drafter the sidecar would
    host made an n-gram drafter of the same name and maximum K: the real control API and policy rules,
    without model weights to load (colocated drafters stay: the sidecar only names them)."""
    config = render.build_sidecar_config(spec)
    drafters = [
        d if d.placement == "colocated" else d.model_copy(update={"method": "ngram", "source": None})
        for d in config.drafters
    ]
    runtime_dir.mkdir(parents=True, exist_ok=True)
    return config.model_copy(
        update={
            "drafters": drafters,
            "model_path": str(runtime_dir),  # no checkpoint: only sizes the warm-up prompts
            "runtime_dir": str(runtime_dir),
            "token_file": None,
            "host": host,
            "port": port,
            "warmup_requests": 0,
        }
    )


class Sidecar:
    """The real sidecar control API (SidecarService behind control_api.build_app) served over real HTTP
    in this process. `puts` records the state after each policy the API accepted; `policy` is the
    policy in force as GET /v1/state reports it; `restart` brings it back as a restarted container would:
    at its start-up policy (version 0), on the same address."""

    def __init__(self, config: SidecarConfig, token: str | None) -> None:
        self.config = config
        self.token = token
        self.service: SidecarService | None = None
        self.runner: web.AppRunner | None = None
        self.puts: list[dict] = []
        self.url = ""

    async def start(self) -> Sidecar:
        self.service = SidecarService(self.config)
        await self.service.start()
        app = build_app(self.service, self.token)

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            response = await handler(request)
            if request.method == "PUT" and response.status < 300:
                self.puts.append(json.loads(response.body))
            return response

        app.middlewares.append(record)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.config.host, self.config.port)
        await site.start()
        host, port = site._server.sockets[0].getsockname()[:2]  # type: ignore[union-attr]
        self.config = self.config.model_copy(update={"port": port})
        self.url = f"http://{host}:{port}"
        return self

    @property
    def policy(self) -> dict:
        assert self.service is not None
        state = self.service.state().model_dump(by_alias=True)
        return {k: state[k] for k in ("policyVersion", "drafter", "mode", "kByBucket")}

    def policy_info(self) -> tuple[str, str, int]:
        """(drafter, mode, policy version) as the sidecar's policy-info metric shows them."""
        assert self.service is not None
        for family in self.service.metrics.registry.collect():
            if family.name == metric_names.SIDECAR_POLICY_INFO.name:
                (sample,) = [s for s in family.samples if s.value == 1]
                labels = sample.labels
                return labels["drafter"], labels["mode"], int(labels["policy_version"])
        raise AssertionError("no policy-info metric")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def restart(self, token: str | None = None) -> Sidecar:
        await self.stop()
        if token is not None:
            self.token = token
        return await self.start()


@pytest.fixture
async def sidecars(tmp_path_factory: pytest.TempPathFactory):
    """`await sidecars(spec=..., host=..., port=..., token=...)`: a started real sidecar for a pod of
    `spec` (default: the controller tests' spec)."""
    started: list[Sidecar] = []

    async def start(
        spec: SpeculativeServingSpec | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = "secret-token",
    ) -> Sidecar:
        config = ngram_sidecar_config(spec or make_spec(), tmp_path_factory.mktemp("sidecar"), host, port)
        s = await Sidecar(config, token).start()
        started.append(s)
        return s

    yield start
    for s in started:
        await s.stop()
