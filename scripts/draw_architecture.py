"""Draws docs/images/architecture.png: the two packages, and the data going round from an engine step to
Prometheus to the tuner to the sidecar and back to the engine, each arrow through the module that
carries it. Every box names a file of the repository (tests/infra/test_architecture_diagram.py checks
that each still exists), so a module that moves breaks the test until the picture follows.

    .venv/bin/python scripts/draw_architecture.py      # rewrites docs/images/architecture.png
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "images" / "architecture.png"
OPERATOR = "operator/specserve_operator"
ENGINE = "engine_sidecar/specserve_engine"

# Colours: what the operator package holds, what the engine package holds, and what neither does.
OPERATOR_FILL, OPERATOR_EDGE = "#dbe8f7", "#2f5f98"
ENGINE_FILL, ENGINE_EDGE = "#fde8cf", "#b5651d"
OTHER_FILL, OTHER_EDGE = "#eeeeee", "#666666"
FLOW = "#c0392b"  # the loop's arrows
DEPLOY = "#2f5f98"


@dataclass(frozen=True)
class Box:
    x: float
    y: float
    w: float
    h: float
    title: str
    note: str = ""
    paths: tuple[str, ...] = ()  # the repository files the box stands for
    fill: str = OTHER_FILL
    edge: str = OTHER_EDGE


def _operator(x: float, y: float, w: float, h: float, title: str, note: str, *files: str) -> Box:
    return Box(x, y, w, h, title, note, tuple(f"{OPERATOR}/{f}" for f in files), OPERATOR_FILL, OPERATOR_EDGE)


def _engine(x: float, y: float, w: float, h: float, title: str, note: str, *files: str) -> Box:
    return Box(x, y, w, h, title, note, tuple(f"{ENGINE}/{f}" for f in files), ENGINE_FILL, ENGINE_EDGE)


BOXES: dict[str, Box] = {
    # The operator. Deploying (top row): the Kubernetes controller in the usual sense.
    "reconciler": _operator(
        0.6,
        8.95,
        3.0,
        1.05,
        "reconciler.py",
        "kopf: create, update, resume,\ndelete; watches Deployments",
        "reconciler.py",
    ),
    "render": _operator(
        4.2, 8.95, 3.0, 1.05, "render/", "spec → Kubernetes objects\n(pure)", "render/children.py"
    ),
    "kube": _operator(7.8, 8.95, 3.0, 1.05, "kube.py", "server-side apply,\nonly what it owns", "kube.py"),
    # Tuning (bottom rows): the policy loop, data flowing right to left.
    "reader": _operator(
        9.1, 6.25, 2.6, 1.25, "tuner/\nreader.py", "4 PromQL queries a tick", "tuner/reader.py"
    ),
    "observations": _operator(
        6.1, 6.25, 2.6, 1.25, "tuner/\nobservations.py", "increases per pod, bucket", "tuner/observations.py"
    ),
    "core": _operator(
        3.2,
        6.25,
        2.5,
        1.25,
        "tuner/core.py",
        "decide: drafter,\nK per bucket; policy.py,\ncostmodel.py",
        "tuner/core.py",
        "tuner/policy.py",
        "tuner/costmodel.py",
    ),
    "loop": _operator(
        0.6, 6.25, 2.2, 1.25, "tuner/loop.py", "a decision per\nresource, pushes", "tuner/loop.py"
    ),
    "timer": _operator(0.6, 7.75, 2.2, 0.55, "tuner/timer.py", "", "tuner/timer.py"),
    "report": _operator(3.2, 7.75, 2.5, 0.55, "tuner/report.py", "", "tuner/report.py"),
    # Outside both packages.
    "kubernetes": Box(
        12.4, 8.95, 3.2, 1.05, "Kubernetes API", "Deployment, ConfigMap, Secret,\nService → the engine pods"
    ),
    "prometheus": Box(
        12.4, 6.25, 3.2, 1.25, "Prometheus", "scrapes engine :8000 and\nsidecar :8081 /metrics"
    ),
    # The engine pod: the sidecar container on the left, the engine container (vLLM) on the right.
    "control_api": _engine(
        0.6,
        3.3,
        2.6,
        1.3,
        "control_api.py",
        "PUT /v1/policy,\n/metrics (server.py)",
        "control_api.py",
        "server.py",
    ),
    "service": _engine(
        3.5, 3.3, 2.5, 1.3, "sidecar_\nservice.py", "the policy in force", "sidecar_service.py"
    ),
    "drafters": _engine(
        0.6,
        0.55,
        2.6,
        1.35,
        "drafters/",
        "ngram, suffix, draft\nmodel, self-speculation",
        "drafters/__init__.py",
    ),
    "draft_socket": _engine(3.5, 0.55, 2.5, 1.35, "draft_socket.py", "answers each step", "draft_socket.py"),
    "policy_json": _engine(
        6.55, 3.3, 2.1, 1.3, "policy.json", "policy_file.py:\natomic write", "policy_file.py"
    ),
    "drafts_sock": _engine(6.55, 0.55, 2.1, 1.35, "drafts.sock", "draft_protocol.py", "draft_protocol.py"),
    "live_policy": _engine(
        9.2,
        3.3,
        2.2,
        1.3,
        "vllm_plugins/\nlive_policy.py",
        "the scheduler's\nK table",
        "vllm_plugins/live_policy.py",
    ),
    "step": Box(11.8, 3.3, 1.3, 1.3, "engine\nstep", "vLLM"),
    "stat_logger": _engine(
        13.5,
        3.3,
        2.15,
        1.3,
        "vllm_plugins/\nstat_logger.py",
        "per-step counters",
        "vllm_plugins/stat_logger.py",
    ),
    "proposer": _engine(
        9.2, 0.55, 2.2, 1.35, "vllm_plugins/\nproposer.py", "custom_class\ndrafts", "vllm_plugins/proposer.py"
    ),
    "engine_args": _engine(
        11.8,
        0.55,
        3.85,
        1.35,
        "engine_args.py",
        "the `vllm serve` argv that loads these\n"
        "plugins; metric_names.py, buckets.py:\nthe names on every series",
        "engine_args.py",
        "metric_names.py",
        "buckets.py",
    ),
}


@dataclass(frozen=True)
class Region:
    x: float
    y: float
    w: float
    h: float
    label: str
    edge: str
    fill: str = "none"
    label_x: float = 0.12  # from the left edge


REGIONS = [
    Region(0.2, 5.95, 11.8, 4.85, f"{OPERATOR}/   (the operator pod)", OPERATOR_EDGE, "#f4f8fd"),
    Region(0.4, 8.8, 11.4, 1.6, "deploys: the Kubernetes controller", OPERATOR_EDGE),
    Region(0.4, 6.1, 11.4, 2.55, "tuner/: tunes speculation (the policy loop)", OPERATOR_EDGE),
    Region(
        0.2, 0.15, 15.7, 5.45, f"{ENGINE}/   (the engine pod, one per replica)", ENGINE_EDGE, "#fffaf3", 3.0
    ),
    Region(0.4, 0.3, 5.8, 4.85, "sidecar container", ENGINE_EDGE),
    Region(6.4, 0.3, 2.4, 4.85, "runtime dir", ENGINE_EDGE),
    Region(9.0, 0.3, 6.85, 4.85, "engine container: vLLM + plugins", ENGINE_EDGE),
]

# The loop, numbered in the order data travels (LEGEND says what each step carries), then the wiring
# around it: (from, to, label, colour).
ARROWS = [
    ("step", "stat_logger", "①", FLOW),
    ("stat_logger", "prometheus", "②", FLOW),
    ("prometheus", "reader", "③", FLOW),
    ("reader", "observations", "④", FLOW),
    ("observations", "core", "⑤", FLOW),
    ("core", "loop", "⑥", FLOW),
    ("loop", "control_api", "⑦", FLOW),
    ("control_api", "service", "", FLOW),
    ("service", "policy_json", "⑧", FLOW),
    ("policy_json", "live_policy", "⑨", FLOW),
    ("live_policy", "step", "⑩", FLOW),
    ("proposer", "drafts_sock", "", ENGINE_EDGE),
    ("drafts_sock", "draft_socket", "", ENGINE_EDGE),
    ("draft_socket", "service", "", ENGINE_EDGE),
    ("service", "drafters", "", ENGINE_EDGE),
    ("timer", "loop", "", DEPLOY),
    ("core", "report", "", DEPLOY),
    ("reconciler", "render", "", DEPLOY),
    ("render", "kube", "", DEPLOY),
    ("kube", "kubernetes", "", DEPLOY),
]

LEGEND = [
    "①  an engine step's batch size, drafts and accepted tokens, counted per batch-size bucket",
    "②  Prometheus scrapes the engine's /metrics (:8000) and the sidecar's (:8081)",
    "③  four PromQL queries a tick read the whole fleet",
    "④  counter increases over the window, per pod and bucket: the snapshot",
    "⑤  decide: the drafter, and K per bucket (0 above the cliff), from acceptance and step times",
    "⑥  a decision per resource (timer.py runs the loop every evaluationInterval; report.py writes status)",
    "⑦  PUT /v1/policy to every pod's sidecar, through specserve_engine/client.py",
    "⑧  the sidecar applies the policy and writes policy.json atomically",
    "⑨  the live-policy scheduler reads policy.json between two engine steps",
    "⑩  the next step verifies K drafts per sequence, K from its batch size's bucket",
    "brown: for sidecar-hosted drafters, the proposer asks the sidecar for drafts each step (drafts.sock)",
]


def repository_paths() -> list[str]:
    """Every repository file the picture names."""
    return sorted({path for box in BOXES.values() for path in box.paths})


def draw(output: Path = OUTPUT) -> Path:
    fig, ax = plt.subplots(figsize=(16, 14.6), dpi=100)
    ax.set_xlim(0, 16)
    ax.set_ylim(-3.0, 11.6)
    ax.set_axis_off()
    ax.text(
        8.0,
        11.55,
        "specserve: from an engine step to Prometheus to the tuner to the sidecar, and back",
        ha="center",
        va="top",
        fontsize=14,
        weight="bold",
    )
    ax.text(
        8.0,
        11.16,
        "paths are relative to each package's folder; import names are folder names",
        ha="center",
        va="top",
        fontsize=10,
        color="#444444",
    )
    for region in REGIONS:
        ax.add_patch(
            FancyBboxPatch(
                (region.x, region.y),
                region.w,
                region.h,
                boxstyle="round,pad=0.02,rounding_size=0.15",
                fc=region.fill,
                ec=region.edge,
                lw=1.2,
                ls="--",
            )
        )
        ax.text(
            region.x + region.label_x,
            region.y + region.h - 0.06,
            region.label,
            ha="left",
            va="top",
            fontsize=10.5,
            color=region.edge,
            weight="bold",
        )
    patches = {}
    for key, box in BOXES.items():
        patch = FancyBboxPatch(
            (box.x, box.y),
            box.w,
            box.h,
            boxstyle="round,pad=0.03,rounding_size=0.1",
            fc=box.fill,
            ec=box.edge,
            lw=1.6,
        )
        ax.add_patch(patch)
        patches[key] = patch
        cx = box.x + box.w / 2
        top = box.y + box.h - 0.12
        ax.text(cx, top, box.title, ha="center", va="top", fontsize=10.5, weight="bold", family="monospace")
        if box.note:
            title_lines = box.title.count("\n") + 1
            ax.text(cx, top - 0.27 * title_lines - 0.05, box.note, ha="center", va="top", fontsize=8.8)
    for source, target, label, colour in ARROWS:
        a, b = BOXES[source], BOXES[target]
        start = (a.x + a.w / 2, a.y + a.h / 2)
        end = (b.x + b.w / 2, b.y + b.h / 2)
        ax.add_patch(
            FancyArrowPatch(
                start,
                end,
                patchA=patches[source],
                patchB=patches[target],
                arrowstyle="-|>",
                mutation_scale=16,
                lw=2.0 if colour == FLOW else 1.4,
                color=colour,
                shrinkA=2,
                shrinkB=2,
            )
        )
        if label:
            # The number sits beside the arrow's middle, off its line.
            mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
            vertical = abs(end[0] - start[0]) < abs(end[1] - start[1])
            x, y = (mx + 0.22, my) if vertical else (mx, my + 0.22)
            ax.text(x, y, label, ha="center", va="center", fontsize=12, color=colour, weight="bold")
    ax.text(
        0.3, -0.1, "\n".join(LEGEND), ha="left", va="top", fontsize=10.5, color="#222222", linespacing=1.55
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, bbox_inches="tight", facecolor="white", metadata={"Software": None})
    plt.close(fig)
    return output


def main() -> int:
    missing = [path for path in repository_paths() if not (REPO / path).exists()]
    if missing:
        print(f"the picture names files that do not exist: {', '.join(missing)}", file=sys.stderr)
        return 1
    print(draw().relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
