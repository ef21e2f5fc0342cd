"""The SpeculativeServing API: the models, the CRD generated from them, and the examples.

Every bad resource in BAD_RESOURCES must be rejected twice, each time naming the field: by the models
(what the operator checks) and by the CRD (its structural schema or its CEL rules, evaluated here with
cel-python as the API server would), so the two cannot drift apart.
"""

from __future__ import annotations

import copy
import itertools
import subprocess
import sys
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import pytest
import yaml
from celpy import celtypes
from pydantic import ValidationError

from specserve_operator.api import crd
from specserve_operator.api.models import (
    METHODS_BY_PLACEMENT,
    SpeculativeServing,
    describe_error,
    parse_duration,
    parse_spec,
)
from specserve_operator.api.reference import reference_markdown

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml") if not p.name.startswith("local-fleet"))
SCHEMA = crd.open_api_schema()


def _good() -> dict[str, Any]:
    return {
        "apiVersion": "specserve.io/v1alpha1",
        "kind": "SpeculativeServing",
        "metadata": {"name": "demo", "namespace": "ns"},
        "spec": {
            "replicas": 2,
            "model": {"name": "tiny", "source": "hf://org/tiny", "tensorParallelSize": 1},
            "engine": {"image": "engine:1", "gpu": {"count": 1}},
            "drafters": [
                {
                    "name": "eagle3",
                    "method": "eagle3",
                    "source": "hf://org/eagle3",
                    "maxSpeculativeTokens": 5,
                },
                {"name": "ngram", "method": "ngram", "maxSpeculativeTokens": 4},
            ],
            "speculation": {"mode": "auto", "defaultDrafter": "eagle3"},
        },
    }


# ---- an API-server-like check of a resource against the generated CRD --------------------------------


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _apply_defaults(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        value = [_apply_defaults(schema["items"], item) for item in value]
    return value


def _is_sorted(items: celtypes.ListType) -> celtypes.BoolType:
    return celtypes.BoolType(all(a <= b for a, b in itertools.pairwise(items)))


def _cel_errors(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    errors = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations", []):
        program = env.program(env.compile(rule["rule"]), functions={"isSorted": _is_sorted})
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            errors.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                errors += _cel_errors(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _cel_errors(schema["items"], item, f"{path}[{i}]")
    return errors


def crd_errors(resource: dict[str, Any]) -> list[str]:
    """Why the API server would reject this resource (schema first, then CEL on the defaulted object)."""
    resource = copy.deepcopy(resource)
    validator = jsonschema.Draft4Validator(SCHEMA)
    schema_errors = [
        ".".join(str(p) for p in err.absolute_path) + f": {err.message}"
        for err in validator.iter_errors(resource)
    ]
    if schema_errors:
        return schema_errors
    resource = _apply_defaults(SCHEMA, resource)
    return _cel_errors(SCHEMA, resource, "")


def model_error(resource: dict[str, Any]) -> str | None:
    try:
        parse_spec(resource["spec"])
    except ValidationError as exc:
        return describe_error(exc)
    return None


# ---- bad resources: (id, how to break the good one, the field the message must name) ------------------


def _set(path: str, value: Any):
    def mutate(r: dict[str, Any]) -> None:
        node = r
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
        node[keys[-1]] = value

    return mutate


def _add_drafter(drafter: dict[str, Any]):
    return lambda r: r["spec"]["drafters"].append(drafter)


def _drop(path: str):
    def mutate(r: dict[str, Any]) -> None:
        node = r
        keys = path.split(".")
        for key in keys[:-1]:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[keys[-1]]

    return mutate


BAD_RESOURCES = [
    ("replicas-string", _set("spec.replicas", "two"), "replicas"),
    ("replicas-negative", _set("spec.replicas", -1), "replicas"),
    ("model-source-scheme", _set("spec.model.source", "ftp://x/y"), "model.source"),
    ("model-name-missing", _drop("spec.model.name"), "name"),
    ("tp-zero", _set("spec.model.tensorParallelSize", 0), "tensorParallelSize"),
    ("gpus-below-tp", _set("spec.model.tensorParallelSize", 2), "engine.gpu.count"),
    ("gpu-count-too-many", _set("spec.engine.gpu.count", 17), "gpu.count"),
    ("image-empty", _set("spec.engine.image", ""), "image"),
    ("gpu-count-negative", _set("spec.engine.gpu.count", -1), "gpu.count"),
    ("parallel-drafting-ngram", _set("spec.drafters.1.parallelDrafting", True), "parallelDrafting"),
    (
        "parallel-drafting-sidecar",
        _add_drafter(
            {
                "name": "d",
                "method": "draftModel",
                "source": "hf://o/d",
                "placement": "sidecar",
                "parallelDrafting": True,
            }
        ),
        "parallelDrafting",
    ),
    ("image-source-absolute", _set("spec.model.source", "image:///etc/passwd"), "model.source"),
    (
        "advise-without-drafters",
        lambda r: r["spec"].update(drafters=[], speculation={"mode": "advise"}),
        "drafters",
    ),
    ("unknown-method", _set("spec.drafters.1.method", "lookahead"), "method"),
    ("k-zero", _set("spec.drafters.0.maxSpeculativeTokens", 0), "maxSpeculativeTokens"),
    ("k-seventeen", _set("spec.drafters.0.maxSpeculativeTokens", 17), "maxSpeculativeTokens"),
    ("k-string", _set("spec.drafters.0.maxSpeculativeTokens", "five"), "maxSpeculativeTokens"),
    ("drafter-name-upper", _set("spec.drafters.1.name", "NGram"), "name"),
    ("duplicate-drafters", _add_drafter({"name": "ngram", "method": "suffix"}), "drafters"),
    ("default-drafter-missing", _set("spec.speculation.defaultDrafter", "medusa"), "defaultDrafter"),
    (
        "eagle3-separate-gpu",
        _set("spec.drafters.0.placement", "separateGpu"),
        "placement",
    ),
    ("self-spec-colocated", _add_drafter({"name": "self", "method": "selfSpeculative"}), "placement"),
    ("ngram-separate-gpu", _set("spec.drafters.1.placement", "separateGpu"), "placement"),
    ("unknown-placement", _set("spec.drafters.1.placement", "remote"), "placement"),
    ("eagle3-without-source", _drop("spec.drafters.0.source"), "source"),
    ("ngram-with-source", _set("spec.drafters.1.source", "hf://org/ngram"), "source"),
    ("mal-floor-one", _set("spec.speculation.malFloor", 1.0), "malFloor"),
    ("min-gain-below-one", _set("spec.speculation.minGain", 0.9), "minGain"),
    ("buckets-not-increasing", _set("spec.speculation.batchBuckets", [1, 4, 2]), "batchBuckets"),
    ("buckets-repeat", _set("spec.speculation.batchBuckets", [1, 2, 2, 4]), "batchBuckets"),
    ("buckets-zero", _set("spec.speculation.batchBuckets", [0, 2]), "batchBuckets"),
    ("buckets-empty", _set("spec.speculation.batchBuckets", []), "batchBuckets"),
    ("interval-not-duration", _set("spec.speculation.evaluationInterval", "thirty"), "evaluationInterval"),
    ("interval-too-short", _set("spec.speculation.evaluationInterval", "500ms"), "evaluationInterval"),
    ("cooldown-no-unit", _set("spec.speculation.cooldown", "300"), "cooldown"),
    ("mode-unknown", _set("spec.speculation.mode", "sometimes"), "mode"),
    ("speculating-without-drafters", _set("spec.drafters", []), "drafters"),
    (
        "two-mtp",
        lambda r: r["spec"]["drafters"].extend(
            [{"name": "mtp-a", "method": "mtp"}, {"name": "mtp-b", "method": "mtp"}]
        ),
        "drafters",
    ),
    ("prometheus-url-scheme", _set("spec.monitoring.prometheusUrl", "prometheus:9090"), "prometheusUrl"),
    # a source that climbs out of its mount, and extraArgs that move the port or set an API key (the
    # operator's own flags, in any spelling vLLM takes: test_engine_pod_hardening.py has them all)
    ("pvc-source-climbs-out", _set("spec.model.source", "pvc://models/../../../etc"), "model.source"),
    ("drafter-source-climbs-out", _set("spec.drafters.0.source", "hf://org/eagle3/.."), "source"),
    ("extra-args-port", _set("spec.engine.extraArgs", ["--port", "9000"]), "extraArgs"),
    ("extra-args-port-abbreviated", _set("spec.engine.extraArgs", ["--po=9000"]), "extraArgs"),
    ("extra-args-host", _set("spec.engine.extraArgs", ["--enable-prefix-caching", "--host=::"]), "extraArgs"),
    ("extra-args-api-key", _set("spec.engine.extraArgs", ["--api-key=hunter2"]), "extraArgs"),
    ("extra-args-underscores", _set("spec.engine.extraArgs", ["--max_model_len", "9"]), "extraArgs"),
    ("extra-args-json-field", _set("spec.engine.extraArgs", ["--speculative-config.method=x"]), "extraArgs"),
    ("extra-args-alias", _set("spec.engine.extraArgs", ["-sc", "{}"]), "extraArgs"),
    ("shm-size-not-a-quantity", _set("spec.engine.shmSize", "lots"), "shmSize"),
    ("engine-cpu-negative", _set("spec.engine.resources.requests.cpu", "-1"), "cpu"),
    ("sidecar-memory-words", _set("spec.sidecar.resources.limits.memory", "8 GiB"), "memory"),
]


def test_there_are_at_least_fifteen_bad_resources() -> None:
    assert len(BAD_RESOURCES) >= 15


def test_the_good_resource_passes_both() -> None:
    assert model_error(_good()) is None
    assert crd_errors(_good()) == []


def test_engine_flags_the_operator_does_not_own_and_explicit_resources_pass_both() -> None:
    resource = _good()
    resource["spec"]["engine"]["extraArgs"] = ["--enable-prefix-caching", "--max-num-batched-tokens", "8192"]
    resource["spec"]["engine"]["resources"] = {"requests": {"cpu": "8", "memory": "64Gi"}}
    resource["spec"]["engine"]["shmSize"] = "16Gi"
    resource["spec"]["sidecar"] = {"resources": {"limits": {"cpu": "1.5", "memory": "512Mi"}}}
    resource["spec"]["model"]["source"] = "pvc://models/llama/v1.2..final"  # dots, but no '..' segment
    assert model_error(resource) is None
    assert crd_errors(resource) == []


@pytest.mark.parametrize(
    ("mutate", "field"), [(m, f) for _, m, f in BAD_RESOURCES], ids=[i for i, _, _ in BAD_RESOURCES]
)
def test_bad_resource_rejected_by_models_naming_the_field(mutate, field: str) -> None:
    resource = _good()
    mutate(resource)
    error = model_error(resource)
    assert error is not None, "the models accepted it"
    assert field in error, error


@pytest.mark.parametrize(
    ("mutate", "field"), [(m, f) for _, m, f in BAD_RESOURCES], ids=[i for i, _, _ in BAD_RESOURCES]
)
def test_bad_resource_rejected_by_the_crd_naming_the_field(mutate, field: str) -> None:
    resource = _good()
    mutate(resource)
    errors = crd_errors(resource)
    assert errors, "the CRD accepted it"
    assert any(field.split(".")[-1] in e for e in errors), errors


# ---- models ------------------------------------------------------------------------------------------


def test_defaults_fill_a_minimal_spec() -> None:
    spec = parse_spec(
        {
            "model": {"name": "m", "source": "pvc://claim/m"},
            "engine": {"image": "i"},
            "drafters": [{"name": "ngram", "method": "ngram"}],
        }
    )
    assert spec.replicas == 1
    assert spec.model.tensor_parallel_size == 1
    assert spec.engine.gpu.count == 1
    assert spec.drafters[0].placement == "colocated"
    assert spec.drafters[0].max_speculative_tokens == 4
    assert spec.speculation.mode == "auto"
    assert spec.speculation.batch_buckets == [1, 2, 4, 8, 16, 32, 64, 128]
    assert spec.speculation.evaluation_interval_seconds == 30
    assert spec.speculation.cooldown_seconds == 300
    assert spec.initial_drafter is not None and spec.initial_drafter.name == "ngram"


MINIMAL = {
    "apiVersion": "specserve.io/v1alpha1",
    "kind": "SpeculativeServing",
    "metadata": {"name": "minimal", "namespace": "ns"},
    "spec": {
        "model": {"name": "m", "source": "hf://org/m"},
        "drafters": [{"name": "ngram", "method": "ngram"}],
        "speculation": {"mode": "auto"},
    },
}


def test_a_minimal_resource_is_accepted_by_both() -> None:
    """A model, one n-gram drafter and mode auto: no engine section (the operator's image is used)."""
    assert model_error(MINIMAL) is None
    assert crd_errors(MINIMAL) == []
    spec = parse_spec(MINIMAL["spec"])
    assert spec.engine.image is None and spec.engine.gpu.count == 1


@pytest.mark.parametrize("mode", ["advise", "auto", "on"])
def test_parallel_drafting_on_a_colocated_eagle3_and_cpu_engines_are_accepted(mode: str) -> None:
    resource = _good()
    resource["spec"]["drafters"][0]["parallelDrafting"] = True
    resource["spec"]["engine"]["gpu"]["count"] = 0
    resource["spec"]["model"]["source"] = "image://tiny-target"
    resource["spec"]["speculation"]["mode"] = mode
    assert model_error(resource) is None
    assert crd_errors(resource) == []


@pytest.mark.parametrize(
    ("text", "seconds"), [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("1.5s", 1.5)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("placement", "method"),
    [(p, m) for p, methods in METHODS_BY_PLACEMENT.items() for m in methods],
)
def test_every_allowed_placement_and_method_pair_is_accepted_by_both(placement: str, method: str) -> None:
    resource = _good()
    drafter: dict[str, Any] = {"name": "x", "method": method, "placement": placement}
    if method in ("eagle3", "eagle", "medusa", "draftModel"):
        drafter["source"] = "hf://org/x"
    resource["spec"]["drafters"] = [drafter]
    resource["spec"]["speculation"] = {"defaultDrafter": "x"}
    assert model_error(resource) is None
    assert crd_errors(resource) == []


def test_wire_round_trip_keeps_camel_case() -> None:
    serving = SpeculativeServing.model_validate(_good())
    wire = serving.to_wire()
    assert wire["spec"]["drafters"][0]["maxSpeculativeTokens"] == 5
    assert wire["spec"]["speculation"]["batchBuckets"][0] == 1
    assert SpeculativeServing.model_validate(wire) == serving


# ---- the CRD -----------------------------------------------------------------------------------------


def _walk(schema: dict[str, Any], path: str = ""):
    yield path, schema
    for key, sub in schema.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_the_schema_is_structural() -> None:
    forbidden = {"$ref", "anyOf", "oneOf", "allOf", "const", "title", "uniqueItems", "$defs"}
    for path, node in _walk(SCHEMA):
        assert "type" in node, f"{path or '<root>'} has no type"
        assert not forbidden & node.keys(), f"{path}: {forbidden & node.keys()}"
        assert not ("properties" in node and "additionalProperties" in node), path
        if "default" in node:
            assert jsonschema.Draft4Validator(node).is_valid(node["default"]), f"{path}: bad default"
        if node.get("x-kubernetes-list-type") == "map":
            keys = node["x-kubernetes-list-map-keys"]
            assert set(keys) <= set(node["items"].get("required", [])), f"{path}: map keys must be required"


def test_crd_has_subresources_columns_and_names() -> None:
    doc = crd.build_crd()
    version = doc["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    for name in ("Phase", "Drafter", "MAL", "Cliff", "Age"):
        assert name in columns
    # every column points at a field the schema has
    for name, json_path in columns.items():
        node: dict[str, Any] = {"properties": {"metadata": {}, **SCHEMA["properties"]}}
        for part in json_path.strip(".").split("."):
            if part == "creationTimestamp":
                break
            node = node["properties"][part]
        assert node, name
    assert doc["spec"]["names"]["shortNames"] == ["specserve", "sps"]
    assert doc["spec"]["scope"] == "Namespaced"


def test_crds_folder_matches_the_generator() -> None:
    on_disk = (REPO / "crds" / crd.CRD_FILE_NAME).read_text()
    assert on_disk == crd.crd_yaml(), "crds/ is stale: run `make crds` (specserve crd --write crds/)"
    assert sorted(p.name for p in (REPO / "crds").glob("*.yaml")) == [crd.CRD_FILE_NAME]


def test_specserve_crd_prints_what_crds_holds(tmp_path: Path) -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "specserve_operator", "crd"], capture_output=True, text=True, check=True
    ).stdout
    assert printed == (REPO / "crds" / crd.CRD_FILE_NAME).read_text()
    subprocess.run([sys.executable, "-m", "specserve_operator", "crd", "--write", str(tmp_path)], check=True)
    assert (tmp_path / crd.CRD_FILE_NAME).read_text() == printed


def test_crd_reference_doc_matches_the_generator() -> None:
    on_disk = (REPO / "docs" / "crd-reference.md").read_text()
    assert on_disk == reference_markdown(), "docs/crd-reference.md is stale: specserve crd --reference > it"
    fields = ("maxSpeculativeTokens", "batchBuckets", "malFloor", "placement", "kByBucket", "cliffBatchSize")
    for field in fields:
        assert f".{field}`" in on_disk


# ---- examples ----------------------------------------------------------------------------------------


def test_there_are_the_four_required_examples() -> None:
    specs = [yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES]
    assert len(specs) >= 4
    drafters = [d for s in specs for d in s.get("drafters", [])]
    assert any(d["method"] == "eagle3" and d.get("placement", "colocated") == "colocated" for d in drafters)
    assert any(s.get("engine", {}).get("gpu") == {"count": 4, "product": "NVIDIA-H200"} for s in specs)
    assert any(d["method"] == "draftModel" and d["placement"] == "separateGpu" for d in drafters)
    assert any({d["method"] for d in s.get("drafters", [])} == {"ngram"} for s in specs)
    assert any(s.get("speculation", {}).get("mode") == "off" for s in specs)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_validates_against_the_crd_and_the_models(path: Path) -> None:
    resource = yaml.safe_load(path.read_text())
    assert crd_errors(resource) == []
    SpeculativeServing.model_validate(resource)
