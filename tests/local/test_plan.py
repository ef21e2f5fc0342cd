"""Manifest → local fleet layout, and the errors a newcomer meets before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from specserve_operator.local.errors import LocalFleetError
from specserve_operator.local.plan import load_manifest, plan_fleet
from specserve_operator.local.preflight import check_memory, require_binary, require_ports_free
from specserve_operator.local.prompts import load_prompts

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "local-fleet.yaml"


@pytest.fixture
def models(tmp_path: Path) -> Path:
    for name in ("tiny-target", "tiny-draft"):
        (tmp_path / "models" / name).mkdir(parents=True)
    return tmp_path / "models"


def _manifest(tmp_path: Path, **spec_changes: object) -> Path:
    raw = yaml.safe_load(EXAMPLE.read_text())
    for key, value in spec_changes.items():
        # A mapping merges into the example's (speculation: {defaultDrafter: x} keeps its buckets).
        if isinstance(value, dict) and isinstance(raw["spec"].get(key), dict):
            raw["spec"][key] = {**raw["spec"][key], **value}
        else:
            raw["spec"][key] = value
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_example_plans_one_pod_per_replica(tmp_path: Path, models: Path) -> None:
    drafters = [
        {
            "name": "tiny-draft",
            "method": "draftModel",
            "source": "pvc://models/tiny-draft",
            "placement": "sidecar",
        },
        {"name": "ngram", "method": "ngram", "placement": "sidecar"},
    ]
    resource = load_manifest(
        _manifest(tmp_path, replicas=2, drafters=drafters, speculation={"defaultDrafter": "tiny-draft"})
    )
    plan = plan_fleet(resource, run_dir=tmp_path / "run", models_dir=models, ports=[1, 2, 3, 4], cpu_cores=2)
    assert [r.name for r in plan.replicas] == ["tiny-0", "tiny-1"]
    assert plan.namespace == "local"
    first, second = plan.replicas
    assert (first.engine_port, first.sidecar.port, second.engine_port, second.sidecar.port) == (1, 2, 3, 4)
    # The engine and the sidecar of a pod share its runtime dir; pods do not share one.
    assert first.engine.runtime_dir == first.sidecar.runtime_dir != second.sidecar.runtime_dir
    assert first.sidecar.engine_url == "http://127.0.0.1:1"
    assert first.engine.model == str(models / "tiny-target")
    assert first.engine.omp_num_threads == 1  # two engines share two cores
    # Both drafters are sidecar-hosted: the engine runs the sidecar proposer sized for the larger K.
    assert first.engine.drafter is not None and first.engine.drafter.placement == "sidecar"
    assert first.sidecar.engine_drafter is None
    assert {d.name: d.source for d in first.sidecar.drafters} == {
        "tiny-draft": str(models / "tiny-draft"),
        "ngram": None,
    }
    # Mode auto: the pods start plain in every bucket, the initial drafter loaded and named.
    policy = first.sidecar.initial_policy
    assert policy.drafter == "tiny-draft" and policy.mode == "on"
    assert set(policy.k_by_bucket.values()) == {0}
    assert list(policy.k_by_bucket) == ["1", "2", "4", "8", "16", "32", "+Inf"]


def test_the_plain_run_gets_a_stock_engine_per_replica(tmp_path: Path, models: Path) -> None:
    resource = load_manifest(_manifest(tmp_path, replicas=2))
    plan = plan_fleet(
        resource, run_dir=tmp_path / "run", models_dir=models, ports=[1, 2, 3, 4], stock_ports=[5, 6]
    )
    assert [(e.port, e.stock, e.drafter) for e in plan.stock_engines] == [(5, True, None), (6, True, None)]
    for replica, stock in zip(plan.replicas, plan.stock_engines, strict=True):
        # The same model and engine settings as the replica's engine: only specserve is missing.
        assert (stock.model, stock.served_model_name, stock.max_model_len, stock.max_num_seqs) == (
            replica.engine.model,
            replica.engine.served_model_name,
            replica.engine.max_model_len,
            replica.engine.max_num_seqs,
        )
        assert stock.omp_num_threads == replica.engine.omp_num_threads
    assert plan_fleet(resource, run_dir=tmp_path, models_dir=models, ports=[1, 2, 3, 4]).stock_engines == ()


def test_colocated_initial_drafter_runs_in_the_engine(tmp_path: Path, models: Path) -> None:
    drafters = [
        {"name": "d", "method": "draftModel", "source": "pvc://models/tiny-draft", "placement": "colocated"},
        {"name": "ngram", "method": "ngram", "placement": "sidecar", "maxSpeculativeTokens": 6},
    ]
    resource = load_manifest(_manifest(tmp_path, drafters=drafters, speculation={"defaultDrafter": "d"}))
    plan = plan_fleet(resource, run_dir=tmp_path, models_dir=models, ports=[1, 2])
    assert plan.replicas[0].engine.drafter is not None
    assert plan.replicas[0].engine.drafter.name == "d"
    assert plan.replicas[0].sidecar.engine_drafter == "d"
    # Started on the sidecar-hosted drafter: the engine gets the proposer sized for the largest K.
    resource = load_manifest(_manifest(tmp_path, drafters=drafters, speculation={"defaultDrafter": "ngram"}))
    plan = plan_fleet(resource, run_dir=tmp_path, models_dir=models, ports=[1, 2])
    assert plan.replicas[0].engine.drafter is not None
    assert plan.replicas[0].engine.drafter.name == "ngram"
    assert plan.replicas[0].sidecar.engine_drafter is None


def test_a_drafter_is_required(tmp_path: Path, models: Path) -> None:
    resource = load_manifest(
        _manifest(tmp_path, drafters=[], speculation={"mode": "off", "defaultDrafter": None})
    )
    with pytest.raises(LocalFleetError, match=r"spec\.drafters"):
        plan_fleet(resource, run_dir=tmp_path, models_dir=models, ports=[1, 2])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("kind: [", "not valid YAML"),
        ("kind: Deployment\nspec: {}", "not a SpeculativeServing manifest"),
        ("kind: SpeculativeServing\nmetadata: {name: x}", "spec: missing"),
    ],
)
def test_bad_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(LocalFleetError, match=message):
        load_manifest(path)


def test_invalid_manifest_names_the_field(tmp_path: Path) -> None:
    path = _manifest(tmp_path, speculation={"defaultDrafter": "nope"})
    with pytest.raises(LocalFleetError) as info:
        load_manifest(path)
    assert "spec.speculation.defaultDrafter" in info.value.message
    assert info.value.hint is not None


def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(LocalFleetError, match="no such file"):
        load_manifest(tmp_path / "absent.yaml")


def test_missing_model_folder_has_a_hint(tmp_path: Path) -> None:
    resource = load_manifest(_manifest(tmp_path))
    with pytest.raises(LocalFleetError) as info:
        plan_fleet(resource, run_dir=tmp_path, models_dir=tmp_path / "nothing", ports=[1, 2])
    assert "spec.model.source" in info.value.message
    assert "--models-dir" in (info.value.hint or "")


def test_memory_check() -> None:
    gib = 1024**3
    check_memory(2, 3 * gib, 8 * gib, 1 * gib)
    with pytest.raises(LocalFleetError) as info:
        check_memory(4, 3 * gib, 8 * gib, 1 * gib)
    assert "not enough memory for 4 replica(s)" in info.value.message
    assert "replicas to 2 or fewer" in (info.value.hint or "")


def test_port_taken() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(LocalFleetError, match=f"port {port} .* already taken"):
            require_ports_free([("Prometheus", port)])


def test_missing_binary() -> None:
    with pytest.raises(LocalFleetError) as info:
        require_binary("specserve-no-such-binary", "testing", "install it")
    assert info.value.hint == "install it"


def test_prompts(tmp_path: Path) -> None:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "code.jsonl").write_text('{"domain": "code", "prompt": "def f("}\n\n')
    with pytest.raises(LocalFleetError, match="no prose prompts"):
        load_prompts(tmp_path)
    (tmp_path / "prompts" / "prose.jsonl").write_text('{"domain": "prose", "prompt": "The"}\nnot json\n')
    with pytest.raises(LocalFleetError, match=r"prose\.jsonl:2"):
        load_prompts(tmp_path)
    (tmp_path / "prompts" / "prose.jsonl").write_text('{"domain": "prose", "prompt": "The"}\n')
    assert load_prompts(tmp_path) == {"code": ["def f("], "prose": ["The"]}
