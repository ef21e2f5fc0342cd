"""The sidecar's drafting service: the policy in force, the drafters it hosts, and every decision about
switching them, without HTTP or sockets (the control API and the draft socket call it; tested directly).

The policy in force is one immutable `InForce` object; the draft threads read it once per call and a
policy change replaces it whole, so a switch (drafter, K table, on/off) lands between two draft calls. A
drafter not yet loaded is loaded and warmed in a background thread (202), then switched to if its policy
is still the newest. Every applied policy is also written to `policy.json`, which the engine's
live-policy plugin reads to apply K per bucket to a colocated drafter.

Each drafter has its own lock (its per-sequence state takes one call at a time), so warming one drafter
never delays the draft calls of another. A drafter that raises costs that step's drafts; after
`MAX_CONSECUTIVE_DRAFTER_ERRORS` calls in a row it is marked failed and drafts nothing until a new
policy names it again (it is then re-loaded and warmed first).

After each answer has gone out, the loaded drafters not in force may draft for a few rows in the shadow
(shadow.py), within a share of the connection's time, so their acceptance on the live traffic is known.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specserve_engine import metric_names
from specserve_engine.api import (
    ApiError,
    DrafterState,
    DrafterStatus,
    PolicyRequest,
    SidecarConfig,
    SidecarDrafter,
    SidecarState,
    validate_k_table,
)
from specserve_engine.buckets import bucket_labels
from specserve_engine.draft_protocol import RowAnswer, RowStatus, RowUpdate
from specserve_engine.drafters import Drafter, DrafterError, Seq, build_drafter
from specserve_engine.policy_file import PodPolicy, write_policy
from specserve_engine.shadow import ShadowDrafts

if TYPE_CHECKING:
    from specserve_engine.draft_socket import SequenceTable

log = logging.getLogger("specserve.sidecar")

WARMUP_PROMPT_TOKENS = 48
WARMUP_STEPS = 4
WARMUP_CONNECTION = -1  # the key space of synthetic warm-up sequences
DEVICE_ENV = "SPECSERVE_DRAFTER_DEVICE"
LIGHT_METHODS = ("ngram", "suffix")  # no weights: loaded at start-up
MAX_CONSECUTIVE_DRAFTER_ERRORS = 10
DRAFTER_ERROR_LOG_INTERVAL_S = 60.0  # after the first traceback, one summary line per interval
MAX_DRAFT_TOKEN = 2**31 - 1  # the draft socket carries i32 tokens


class PolicyRefused(Exception):
    """A control call that cannot be applied: the HTTP status and the ApiError body."""

    def __init__(self, status: int, error: str, field: str | None = None) -> None:
        super().__init__(error)
        self.status = status
        self.body = ApiError(error=error, field=field)


@dataclass(frozen=True)
class InForce:
    """The policy in force and the sidecar drafter that serves it (None: a colocated drafter, or none)."""

    request: PolicyRequest
    drafter: Drafter | None
    bounds: tuple[int, ...]

    def k_for_batch(self, batch_size: int) -> int:
        return self.pod_policy().k_for_batch(batch_size)

    def pod_policy(self) -> PodPolicy:
        r = self.request
        return PodPolicy(r.policy_version, r.drafter, r.mode, dict(r.k_by_bucket), self.bounds)


def same_policy(a: PolicyRequest, b: PolicyRequest) -> bool:
    return (a.drafter, a.mode, a.k_by_bucket) == (b.drafter, b.mode, b.k_by_bucket)


def change_kinds(old: PolicyRequest, new: PolicyRequest) -> list[str]:
    kinds = []
    if old.drafter != new.drafter:
        kinds.append("drafter")
    if old.k_by_bucket != new.k_by_bucket:
        kinds.append("k")
    if old.mode != new.mode:
        kinds.append("mode")
    return kinds


class SidecarMetrics:
    def __init__(self, bucket_bounds: list[int]) -> None:
        self.registry = CollectorRegistry()
        m = metric_names.SIDECAR_POLICY_INFO
        self.policy_info = Gauge(m.name, m.help, m.labels, registry=self.registry)
        m = metric_names.SIDECAR_K
        self.k = Gauge(m.name, m.help, m.labels, registry=self.registry)
        m = metric_names.SIDECAR_SWITCHES
        self.switches = Counter(m.name, m.help, m.labels, registry=self.registry)
        m = metric_names.SIDECAR_DRAFTER_ERRORS
        self.drafter_errors = Counter(m.name, m.help, m.labels, registry=self.registry)
        m = metric_names.SIDECAR_DRAFT_SECONDS
        self.draft_seconds = Histogram(
            m.name,
            m.help,
            m.labels,
            registry=self.registry,
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
        m = metric_names.SIDECAR_SHADOW_PROPOSED
        self.shadow_proposed = Counter(m.name, m.help, m.labels, registry=self.registry)
        m = metric_names.SIDECAR_SHADOW_ACCEPTED
        self.shadow_accepted = Counter(m.name, m.help, m.labels, registry=self.registry)
        m = metric_names.SIDECAR_SHADOW_ROWS
        self.shadow_rows = Counter(m.name, m.help, m.labels, registry=self.registry)
        self.labels = bucket_labels(bucket_bounds)
        # The policy changes on the event loop, a drafter fails on a draft thread.
        self._show_lock = threading.Lock()

    def shadow_scored(self, drafter: str, length: int, matched: int) -> None:
        self.shadow_rows.labels(drafter).inc()
        for pos in range(length):
            self.shadow_proposed.labels(drafter, str(pos)).inc()
        for pos in range(matched):
            self.shadow_accepted.labels(drafter, str(pos)).inc()

    def show(self, policy: PolicyRequest, drafter_status: DrafterStatus) -> None:
        with self._show_lock:
            self.policy_info.clear()
            self.policy_info.labels(
                policy.drafter, policy.mode, str(policy.policy_version), drafter_status
            ).set(1)
            for label in self.labels:
                self.k.labels(label).set(policy.k_for_bucket(label))


class SidecarService:
    """The sidecar's state and every decision about it, without HTTP (tested directly)."""

    def __init__(self, config: SidecarConfig, device: str | None = None) -> None:
        self.config = config
        self.bounds = tuple(config.bucket_bounds)
        self.metrics = SidecarMetrics(config.bucket_bounds)
        self.specs: dict[str, SidecarDrafter] = {}
        self.drafters: dict[str, Drafter] = {}
        self.status: dict[str, tuple[DrafterStatus, str | None]] = {}  # name -> (status, error)
        for spec in config.drafters:
            if spec.placement == "colocated":
                if spec.name == config.engine_drafter:  # only the engine's own drafter switches live
                    self.specs[spec.name] = spec
                    self.status[spec.name] = ("loaded", None)
                continue
            if config.engine_drafter is not None:
                continue  # the engine runs a colocated drafter: it never calls the sidecar for drafts
            self.specs[spec.name] = spec
            try:
                self.drafters[spec.name] = build_drafter(spec, config.model_path, device or drafter_device())
                self.status[spec.name] = ("available", None)
            except DrafterError as exc:
                self.status[spec.name] = ("failed", str(exc))
        self.vocab_size = _vocab_size(config.model_path)
        # Drafters keep per-sequence state: one call at a time per drafter.
        self.locks = {name: threading.Lock() for name in self.drafters}
        self._errors_lock = threading.Lock()
        self._consecutive_errors = dict.fromkeys(self.drafters, 0)
        self._error_logged_at: dict[str, float] = {}
        self._errors_since_log = dict.fromkeys(self.drafters, 0)
        # Each hosted drafter's error series exists from the start, at 0: a burst of failures between two
        # scrapes must show as an increase, not as a new series whose first sample is already 10.
        for name in self.drafters:
            self.metrics.drafter_errors.labels(name)
        self._shadows: dict[int, ShadowDrafts] = {}  # engine connection → its shadow drafts
        self._shadow_failed: set[str] = set()  # drafters whose shadow pass raised (logged once each)
        self.warm = False
        self.engine_reachable = False
        self.pending: PolicyRequest | None = None
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._apply_lock = asyncio.Lock()
        self.check(config.initial_policy)
        self.in_force = InForce(config.initial_policy, None, self.bounds)  # no drafts until start()

    # --- the control API's decisions ---------------------------------------------------------------
    def check(self, req: PolicyRequest) -> None:
        """Refuse (422) a policy that names no switchable drafter or a K table the drafter cannot take."""
        spec = self.specs.get(req.drafter)
        if spec is None:
            known = ", ".join(sorted(self.specs)) or "none"
            raise PolicyRefused(
                422,
                f"drafter {req.drafter!r} cannot be switched to live in this pod (live drafters: {known}); "
                "another colocated drafter needs a rolling restart",
                "drafter",
            )
        why = validate_k_table(req.k_by_bucket, list(self.bounds), spec.max_speculative_tokens)
        if why is not None:
            raise PolicyRefused(422, why, "kByBucket")
        if spec.placement != "colocated" and req.drafter not in self.drafters:
            raise PolicyRefused(
                422, f"drafter {req.drafter!r} cannot be built: {self.status[req.drafter][1]}", "drafter"
            )

    async def put_policy(self, req: PolicyRequest) -> int:
        """Apply (200) or schedule (202) a policy; raises PolicyRefused with nothing changed."""
        async with self._apply_lock:
            kinds = change_kinds(self.in_force.request, req)
            try:
                status = await self._put(req)
            except PolicyRefused:
                for kind in kinds or ["drafter"]:
                    self.metrics.switches.labels(kind, "refused").inc()
                raise
            return status

    async def _put(self, req: PolicyRequest) -> int:
        cur = self.in_force.request
        if req.policy_version < cur.policy_version:
            raise PolicyRefused(
                409,
                f"policyVersion {req.policy_version} is older than the one in force ({cur.policy_version})",
                "policyVersion",
            )
        if req.policy_version == cur.policy_version:
            if same_policy(req, cur):
                return 200  # idempotent repeat
            raise PolicyRefused(
                409,
                f"policyVersion {req.policy_version} is already in force with other content",
                "policyVersion",
            )
        pending = self.pending
        if pending is not None and req.policy_version <= pending.policy_version:
            if req.policy_version == pending.policy_version and same_policy(req, pending):
                return 202
            raise PolicyRefused(
                409,
                f"policyVersion {req.policy_version} is not newer than the pending version "
                f"{pending.policy_version}",
                "policyVersion",
            )
        self.check(req)
        state, _ = self.status[req.drafter]
        if state == "loaded":
            self.pending = None
            self._apply(req)
            return 200
        self.pending = req
        if req.drafter not in self._loads:
            self.status[req.drafter] = ("loading", None)
            self._loads[req.drafter] = asyncio.create_task(self._load_then_apply(req.drafter))
        return 202

    def _apply(self, req: PolicyRequest) -> None:
        old = self.in_force.request
        new = InForce(req, self.drafters.get(req.drafter), self.bounds)
        try:
            write_policy(new.pod_policy(), self.config.runtime_dir)
        except OSError as exc:
            raise PolicyRefused(500, f"cannot write the policy file: {exc}") from exc
        self.in_force = new  # the switch: draft threads read this reference once per call
        self._show_policy()
        for kind in change_kinds(old, req):
            self.metrics.switches.labels(kind, "applied").inc()
        log.info(
            "policy %d in force: drafter=%s mode=%s K=%s",
            req.policy_version,
            req.drafter,
            req.mode,
            req.k_by_bucket,
        )

    async def _load_then_apply(self, name: str) -> None:
        try:
            await self.load(name)
        finally:
            self._loads.pop(name, None)
        async with self._apply_lock:
            pending = self.pending
            if pending is None or pending.drafter != name:
                return
            self.pending = None
            if self.status[name][0] != "loaded":
                self.metrics.switches.labels("drafter", "failed").inc()
                return
            try:
                self._apply(pending)
            except PolicyRefused as exc:
                log.error("pending policy %d not applied: %s", pending.policy_version, exc)
                self.metrics.switches.labels("drafter", "failed").inc()

    async def load(self, name: str) -> None:
        """Load and warm a drafter in a worker thread; the drafters in force keep serving meanwhile."""
        drafter = self.drafters.get(name)
        if drafter is None:
            return
        self.status[name] = ("loading", None)
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self._load_and_warm, drafter)
        except Exception as exc:  # a bad checkpoint must not take the sidecar down
            log.exception("drafter %s failed to load", name)
            self.status[name] = ("failed", f"{type(exc).__name__}: {exc}")
            self._show_policy()
            return
        self._consecutive_errors[name] = 0
        self.status[name] = ("loaded", None)
        self._show_policy()
        log.info("drafter %s loaded and warmed in %.2f s", name, time.perf_counter() - t0)

    def _show_policy(self) -> None:
        req = self.in_force.request
        self.metrics.show(req, self.status[req.drafter][0])

    def _load_and_warm(self, drafter: Drafter) -> None:
        drafter.load()
        rng = np.random.default_rng(0)
        n = max(1, self.config.warmup_requests)
        for i in range(n):
            tokens = rng.integers(0, self.vocab_size, WARMUP_PROMPT_TOKENS, dtype=np.int32)
            tokens = np.concatenate([tokens, tokens[: WARMUP_PROMPT_TOKENS // 2]])  # something to look up
            for step in range(WARMUP_STEPS):
                seq = Seq((WARMUP_CONNECTION, i), 0, tokens[: len(tokens) - WARMUP_STEPS + step + 1])
                with self.locks[drafter.name]:
                    drafter.draft([seq], [drafter.max_k])
        with self.locks[drafter.name]:
            drafter.forget(WARMUP_CONNECTION)

    async def start(self) -> None:
        """Load and warm the initial drafter, put the initial policy in force, then report ready.
        The weightless drafters are loaded too; model drafters load when a policy first names them."""
        initial = self.config.initial_policy
        if self.status[initial.drafter][0] != "loaded":
            await self.load(initial.drafter)
            if self.status[initial.drafter][0] != "loaded":
                raise DrafterError(f"initial drafter {initial.drafter}: {self.status[initial.drafter][1]}")
        self._apply(initial)
        for name, drafter in self.drafters.items():
            if self.status[name][0] == "available" and drafter.method in LIGHT_METHODS:
                await self.load(name)
        self.warm = True

    def state(self) -> SidecarState:
        r = self.in_force.request
        drafters = []
        for name, spec in self.specs.items():
            status, error = self.status[name]
            drafters.append(
                DrafterState(
                    name=name,
                    method=spec.method,
                    placement=spec.placement,
                    max_speculative_tokens=spec.max_speculative_tokens,
                    status=status,
                    error=error,
                )
            )
        return SidecarState(
            policy_version=r.policy_version,
            drafter=r.drafter,
            mode=r.mode,
            k_by_bucket=dict(r.k_by_bucket),
            drafters=drafters,
            pending_drafter=self.pending.drafter if self.pending else None,
            warm=self.warm,
            engine_reachable=self.engine_reachable,
        )

    # --- the draft socket's work --------------------------------------------------------------------
    def answer(self, table: SequenceTable, rows: list[RowUpdate], batch_size: int) -> list[RowAnswer]:
        force = self.in_force  # read once: the whole call sees one policy
        drafter = force.drafter
        if drafter is not None and self.status[drafter.name][0] != "loaded":
            drafter = None  # marked failed (or being warmed again): no drafts
        k = force.k_for_batch(batch_size) if drafter is not None else 0
        answers = [RowAnswer(RowStatus.OK, []) for _ in rows]
        seqs: list[Seq] = []
        ks: list[int] = []
        where: list[int] = []
        table.last_rows = []
        for i, row in enumerate(rows):
            seq = table.update(row)
            if seq is None:
                answers[i] = RowAnswer(RowStatus.RESYNC, [])
                continue
            table.last_rows.append((seq, row.max_k))
            row_k = min(k, row.max_k)
            if drafter is not None and row_k > 0:
                seqs.append(seq)
                ks.append(min(row_k, drafter.max_k))
                where.append(i)
        if not seqs:
            return answers
        assert drafter is not None
        name = drafter.name
        t0 = time.perf_counter()
        try:
            with self.locks[name]:
                drafts = drafter.draft(seqs, ks)
            # Checked here, inside the try: a drafter that returns the wrong shape fails like one that raises.
            checked = [(i, _draft_tokens(d, kk)) for i, d, kk in zip(where, drafts, ks, strict=True)]
        except Exception as exc:  # a drafter bug costs this step's drafts, never the engine's requests
            self._drafter_raised(name, exc)
            return answers
        finally:
            self.metrics.draft_seconds.labels(name).observe(time.perf_counter() - t0)
        if self._consecutive_errors[name]:
            self._consecutive_errors[name] = 0
        for i, tokens in checked:
            answers[i] = RowAnswer(RowStatus.OK, tokens)
        return answers

    def _drafter_raised(self, name: str, exc: Exception) -> None:
        """Count a failed draft call; log the first with its traceback, then one line per interval; mark
        the drafter failed after MAX_CONSECUTIVE_DRAFTER_ERRORS in a row."""
        self.metrics.drafter_errors.labels(name).inc()
        with self._errors_lock:
            failures = self._consecutive_errors[name] = self._consecutive_errors[name] + 1
            self._errors_since_log[name] += 1
            now = time.monotonic()
            logged_at = self._error_logged_at.get(name)
            if logged_at is None:
                log.error("drafter %s raised on a draft call (no drafts this step)", name, exc_info=exc)
            elif now - logged_at >= DRAFTER_ERROR_LOG_INTERVAL_S:
                log.error(
                    "drafter %s: %d draft calls raised in the last %.0f s; latest: %r",
                    name,
                    self._errors_since_log[name],
                    now - logged_at,
                    exc,
                )
            if logged_at is None or now - logged_at >= DRAFTER_ERROR_LOG_INTERVAL_S:
                self._error_logged_at[name] = now
                self._errors_since_log[name] = 0
            if failures < MAX_CONSECUTIVE_DRAFTER_ERRORS or self.status[name][0] != "loaded":
                return
            self.status[name] = ("failed", f"{failures} draft calls in a row raised; latest: {exc!r}")
        log.error(
            "drafter %s marked failed after %d draft calls in a row raised: it drafts nothing until a new "
            "policy names it",
            name,
            failures,
        )
        self._show_policy()

    def shadow_pass(self, table: SequenceTable) -> None:
        """After an answer went out: score the connection's pending shadow drafts against the rows' new
        tokens, then let the loaded drafters not in force whose time budgets allow draft for a few rows
        (shadow.py). A shadow drafter that raises costs its shadow pass, never the connection."""
        if self.config.shadow_share <= 0 or not table.last_rows:
            return
        shadow = self._shadows.get(table.connection)
        if shadow is None:
            shadow = self._shadows[table.connection] = ShadowDrafts(
                self.metrics.shadow_scored, self._shadow_raised, share=self.config.shadow_share
            )
        shadow.score([seq for seq, _ in table.last_rows])
        live = self.in_force.request.drafter
        others = [d for n, d in self.drafters.items() if n != live and self.status[n][0] == "loaded"]
        if others:
            shadow.draft(others, table.last_rows, self.locks)

    def _shadow_raised(self, name: str, exc: Exception) -> None:
        if name not in self._shadow_failed:
            self._shadow_failed.add(name)
            log.error("drafter %s raised drafting in the shadow (logged once)", name, exc_info=exc)

    def forget(self, connection: int) -> None:
        self._shadows.pop(connection, None)
        for drafter in self.drafters.values():
            with self.locks[drafter.name]:
                drafter.forget(connection)


def _draft_tokens(drafts: list[int], k: int) -> list[int]:
    tokens = [int(t) for t in drafts[:k]]
    if tokens and not (min(tokens) >= 0 and max(tokens) <= MAX_DRAFT_TOKEN):
        raise ValueError(f"draft token outside 0..{MAX_DRAFT_TOKEN}: {tokens}")
    return tokens


def drafter_device() -> str:
    """Where model drafters run: SPECSERVE_DRAFTER_DEVICE, else the container's GPU, else the CPU. With
    placement separateGpu the pod gives the sidecar container a GPU of its own, seen here as cuda:0."""
    return os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")


def _vocab_size(model_path: str) -> int:
    try:
        return int(json.loads((Path(model_path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return 1000  # only sizes the synthetic warm-up prompts
