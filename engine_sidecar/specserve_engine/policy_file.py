"""The policy in force inside a pod, shared between the sidecar (writer) and the vLLM plugins (readers)
through one JSON file in the runtime directory that both containers mount.

Writes are atomic (write, fsync, rename); readers stat the file each engine step and parse it only when
its modification time changes, so a step pays one `stat` call.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specserve_engine.buckets import DEFAULT_BUCKETS, INF, bucket_for

POLICY_FILE_NAME = "policy.json"
# How often an engine looks at the policy file. Its scheduler and stat logger ask every step, and a stat()
# there cost 150 µs a step on this CPU where the engine's processes share a core (the system call lets
# the spinning worker run): 4 % of the engine core's time at batch 1 (docs/engine-pod.md#off-costs-nothing).
# Policies change every few seconds at most; 50 ms more before one applies is small against the 1 s
# switch-latency goal (docs/sidecar.md).
POLICY_RECHECK_S = 0.05
RUNTIME_DIR_ENV = "SPECSERVE_RUNTIME_DIR"


@dataclass(frozen=True)
class PodPolicy:
    policy_version: int
    drafter: str
    mode: str  # "on" | "off"
    k_by_bucket: dict[str, int]
    bucket_bounds: tuple[int, ...] = DEFAULT_BUCKETS

    def k_for_batch(self, batch_size: int) -> int:
        if self.mode == "off":
            return 0
        return self.k_by_bucket.get(bucket_for(batch_size, self.bucket_bounds), 0)

    def to_json(self) -> dict:
        return {
            "policyVersion": self.policy_version,
            "drafter": self.drafter,
            "mode": self.mode,
            "kByBucket": self.k_by_bucket,
            "bucketBounds": list(self.bucket_bounds),
        }

    @classmethod
    def from_json(cls, data: dict) -> PodPolicy:
        return cls(
            policy_version=int(data["policyVersion"]),
            drafter=str(data["drafter"]),
            mode=str(data["mode"]),
            k_by_bucket={str(k): int(v) for k, v in data["kByBucket"].items()},
            bucket_bounds=tuple(int(b) for b in data.get("bucketBounds", DEFAULT_BUCKETS)),
        )

    def schedule(self, max_batch: int) -> list[tuple[int, int, int]]:
        """The policy as vLLM's dynamic-SD schedule: inclusive (start, end, K) ranges over 1..max_batch."""
        ranges: list[tuple[int, int, int]] = []
        start = 1
        for bound in (*self.bucket_bounds, None):
            end = max_batch if bound is None else min(bound, max_batch)
            if start > end:
                continue
            label = INF if bound is None else str(bound)
            k = 0 if self.mode == "off" else self.k_by_bucket.get(label, 0)
            ranges.append((start, end, k))
            start = end + 1
        return ranges


def policy_path(runtime_dir: str | os.PathLike[str] | None = None) -> Path:
    base = runtime_dir if runtime_dir is not None else os.environ.get(RUNTIME_DIR_ENV, "/run/specserve")
    return Path(base) / POLICY_FILE_NAME


def write_policy(policy: PodPolicy, runtime_dir: str | os.PathLike[str] | None = None) -> Path:
    path = policy_path(runtime_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".policy-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(policy.to_json(), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


@dataclass
class PolicyReader:
    """Reads the policy file at most every `recheck_s`, re-parsing only when it changed; keeps the last good
    policy on a bad file."""

    path: Path
    recheck_s: float = POLICY_RECHECK_S
    _checked: float | None = None  # time.monotonic() of the last look at the file
    _stamp: tuple[int, int] = (-1, -1)  # (inode, mtime): every atomic replace makes a new inode
    _policy: PodPolicy | None = field(default=None, repr=False)

    def current(self) -> PodPolicy | None:
        now = time.monotonic()
        if self._checked is not None and now - self._checked < self.recheck_s:
            return self._policy
        self._checked = now
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self._policy
        stamp = (st.st_ino, st.st_mtime_ns)
        if stamp != self._stamp:
            try:
                self._policy = PodPolicy.from_json(json.loads(self.path.read_text()))
                self._stamp = stamp
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a torn or bad file: keep the last good policy, retry at the next look
        return self._policy
