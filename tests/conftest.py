"""Shared test configuration. Fixtures that start real engines, Prometheus and the kmock API server live
in tests/specserve_testing/ and are loaded here, so that every suite shares the same few engines (vLLM
takes about a minute to start on the CPU)."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Tools installed by scripts/setup.sh (helm) are found without changing the caller's PATH.
os.environ["PATH"] = f"{REPO / '.cache' / 'bin'}{os.pathsep}{os.environ['PATH']}"

pytest_plugins = [
    "specserve_testing.prometheus",
    "specserve_testing.engines",
    "specserve_testing.kmock_emulator",
]
