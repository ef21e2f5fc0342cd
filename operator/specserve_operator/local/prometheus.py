"""A real Prometheus process on 127.0.0.1, for the local fleet and for tests.

Debian's `prometheus` package provides the binary (scripts/setup.sh installs it); nothing here fakes it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from specserve_engine.launch import free_port
from specserve_engine.processes import GroupProcess

INSTALL_HINT = "install it with scripts/setup.sh (or: apt-get install prometheus)"


class PrometheusError(RuntimeError):
    pass


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise PrometheusError(f"`{name}` was not found on PATH: {INSTALL_HINT}")
    return path


def scrape_config(
    job: str, targets: Sequence[str], interval_s: float = 1.0, labels: dict | None = None
) -> dict:
    """One scrape job for targets given as host:port."""
    static: dict = {"targets": list(targets)}
    if labels:
        static["labels"] = labels
    return {"job_name": job, "scrape_interval": f"{interval_s:g}s", "static_configs": [static]}


@dataclass
class PrometheusProcess:
    """Prometheus with its own config, rule files and data directory; stop() leaves no process behind."""

    scrape_configs: list[dict] = field(default_factory=list)
    rule_files: list[Path] = field(default_factory=list)
    data_dir: Path | None = None
    port: int | None = None
    evaluation_interval_s: float = 1.0
    log_path: Path | None = None
    _group: GroupProcess | None = field(default=None, init=False, repr=False)
    _workdir: Path | None = field(default=None, init=False, repr=False)
    _log_path: Path | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> PrometheusProcess:
        binary = require_binary("prometheus")
        self._workdir = Path(tempfile.mkdtemp(prefix="specserve-prometheus-"))
        self.data_dir = self.data_dir or self._workdir / "data"
        self.port = self.port or free_port()
        config = {
            "global": {
                "scrape_interval": "1s",
                "evaluation_interval": f"{self.evaluation_interval_s:g}s",
            },
            "rule_files": [str(Path(p).resolve()) for p in self.rule_files],
            "scrape_configs": self.scrape_configs,
        }
        config_path = self._workdir / "prometheus.yml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        log_path = self._log_path = self.log_path or self._workdir / "prometheus.log"
        # Its own process group (a Ctrl-C in the terminal reaches us only), and it dies with us.
        self._group = GroupProcess(
            "prometheus",
            [
                binary,
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.data_dir}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=30d",
                "--log.level=warn",
            ],
            log_path,
        )
        self._group.start()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        def answers_ready() -> bool:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                return resp.status == 200

        if not self._poll(answers_ready, timeout_s):
            self.stop()
            raise PrometheusError(f"prometheus did not become ready on {self.url} within {timeout_s:.0f}s")

    def wait_scraped(self, timeout_s: float = 30.0) -> None:
        """Wait until every configured target has been scraped and answered. Prometheus hands a new
        config's targets to its scrapers only after its discovery's first update (about 5 s), so traffic
        started at `start()` would run that long with no metrics, which a cluster's Prometheus, running
        long before the pods, never does."""
        static = [s for job in self.scrape_configs for s in job.get("static_configs", [])]
        expected = sum(len(s["targets"]) for s in static)
        targets: list[dict] = []

        def all_up() -> bool:
            nonlocal targets
            with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=2) as resp:
                targets = json.load(resp)["data"]["activeTargets"]
            return len(targets) >= expected and all(t["health"] == "up" for t in targets)

        if self._poll(all_up, timeout_s):
            return
        down = [f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}".strip() for t in targets]
        raise PrometheusError(
            f"prometheus did not scrape all {expected} target(s) within {timeout_s:.0f}s: "
            + ("; ".join(down) if down else "no active targets yet")
        )

    def _poll(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Ask `done` every 0.2 s until it answers true (True) or `timeout_s` passes (False). A Prometheus
        that exits meanwhile is reported at once, with its log's tail, not after the timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self._group.returncode() if self._group is not None else None
            if code is not None:
                log = self._log_path
                tail = log.read_text(errors="replace")[-2000:] if log is not None else ""
                self.stop()
                hint = f" (is port {self.port} taken?)" if "address already in use" in tail else ""
                raise PrometheusError(f"prometheus exited with code {code}{hint}:\n{tail}")
            try:
                if done():
                    return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.stop(grace_s=10.0)
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def __enter__(self) -> PrometheusProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
