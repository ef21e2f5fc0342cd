"""Fixtures of the sidecar suites: a small random Llama checkpoint (for the drafter arithmetic; the
acceptance tests use the trained tiny models under models/), sidecar configurations, a sidecar
service with its draft socket running in this process, and the whole sidecar (server.serve: control
API, draft socket and service) running in this process's event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from specserve_engine.api import PolicyRequest, SidecarConfig
from specserve_engine.draft_protocol import SOCKET_NAME
from specserve_engine.draft_socket import DraftSocketServer
from specserve_engine.sidecar_service import SidecarService
from specserve_testing.inprocess_sidecar import RunningSidecar, free_port, running_sidecar


@pytest.fixture(scope="session")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("random-llama")
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def sidecar_config(runtime_dir: Path, model_path: Path, **overrides: object) -> SidecarConfig:
    base = {
        "modelName": "tiny",
        "modelPath": str(model_path),
        "drafters": [
            {"name": "ngram", "method": "ngram", "maxSpeculativeTokens": 4, "placement": "sidecar"},
            {"name": "suffix", "method": "suffix", "maxSpeculativeTokens": 4, "placement": "sidecar"},
            {
                "name": "self",
                "method": "selfSpeculative",
                "maxSpeculativeTokens": 3,
                "placement": "sidecar",
                "layers": 1,
            },
        ],
        "bucketBounds": [1, 2, 4, 8],
        "runtimeDir": str(runtime_dir),
        "port": 0,
        "warmupRequests": 2,
        "initialPolicy": {"policyVersion": 1, "drafter": "ngram", "mode": "on", "kByBucket": _k_all(4)},
    }
    base.update(overrides)
    return SidecarConfig.model_validate(base)


def _k_all(k: int) -> dict[str, int]:
    return {b: k for b in ("1", "2", "4", "8", "+Inf")}


def policy(version: int, drafter: str = "ngram", k: int = 4, mode: str = "on") -> PolicyRequest:
    return PolicyRequest.model_validate(
        {"policyVersion": version, "drafter": drafter, "mode": mode, "kByBucket": _k_all(k)}
    )


@pytest.fixture
def config(tmp_path: Path, random_llama: Path) -> SidecarConfig:
    return sidecar_config(tmp_path / "run", random_llama)


@pytest.fixture
async def service(config: SidecarConfig) -> SidecarService:
    svc = SidecarService(config)
    await svc.start()
    return svc


@pytest.fixture
def draft_server(service: SidecarService, config: SidecarConfig) -> Iterator[DraftSocketServer]:
    server = DraftSocketServer(service, Path(config.runtime_dir) / SOCKET_NAME)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def draft_socket(draft_server: DraftSocketServer) -> Path:
    return draft_server.path


@pytest.fixture
def make_policy() -> Callable[..., PolicyRequest]:
    return policy


@pytest.fixture
async def start_sidecar(
    tmp_path: Path, random_llama: Path
) -> AsyncIterator[Callable[..., Awaitable[RunningSidecar]]]:
    """Starts the whole sidecar in this event loop with config overrides; ready when the call returns."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: object) -> RunningSidecar:
            runtime_dir = tmp_path / f"sidecar-{free_port()}"
            config = sidecar_config(
                runtime_dir, random_llama, host="127.0.0.1", port=free_port(), **overrides
            )
            return await stack.enter_async_context(running_sidecar(config))

        yield start
