"""The operator as a process of its own, for the fault-injection suite (tests/faults/): the real handlers
(runner.HANDLER_MODULES) against the kmock API server that KUBECONFIG names, with the kmock tests' kopf
settings, the controller ticking every second, and the operator's metrics on 127.0.0.1:$FAULTS_METRICS_PORT.

A process, not a thread, so that a scenario can SIGKILL it and start another, as a node would.
Run: `python -m specserve_testing.fault_operator` (tests/ on PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import logging
import os

TICK_ENV = "SPECSERVE_CONTROLLER_TICK_S"
METRICS_PORT_ENV = "FAULTS_METRICS_PORT"
CONFLICT_RETRY_ENV = "FAULTS_CONFLICT_RETRY_S"
os.environ.setdefault(TICK_ENV, "1")  # read when the timer module is imported, below

import prometheus_client  # noqa: E402

from specserve_operator import reconciler, runner  # noqa: E402
from specserve_testing.kmock_emulator import fast_settings  # noqa: E402


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # As tests/operator does with monkeypatch: a name collision is re-checked within a scenario's time.
    reconciler.CONFLICT_RETRY_S = float(os.environ.get(CONFLICT_RETRY_ENV, reconciler.CONFLICT_RETRY_S))
    prometheus_client.start_http_server(int(os.environ[METRICS_PORT_ENV]), addr="127.0.0.1")
    asyncio.run(runner.run_operator(standalone=True, settings=fast_settings()))


if __name__ == "__main__":
    main()
