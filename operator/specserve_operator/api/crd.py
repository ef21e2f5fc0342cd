"""The SpeculativeServing CustomResourceDefinition, generated from the pydantic models.

pydantic's JSON Schema is rewritten into a Kubernetes structural schema: references inlined, optional
fields' `anyOf [X, null]` folded into X, JSON Schema 2020 bounds turned into OpenAPI v3.0 ones, fields
with factory defaults given their default, and `additionalProperties: false` dropped (the API server
prunes unknown fields instead). CEL rules come from the models' `x-kubernetes-validations`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from specserve_operator.api import models

CRD_NAME = f"{models.PLURAL}.{models.GROUP}"
CRD_FILE_NAME = f"{models.GROUP}_{models.PLURAL}.yaml"

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Drafter", "type": "string", "jsonPath": ".status.activeDrafter"},
    {
        "name": "MAL",
        "type": "number",
        "format": "float",
        "jsonPath": ".status.fleet.meanAcceptedLength",
        "description": "Fleet-wide mean accepted length",
    },
    {
        "name": "Cliff",
        "type": "integer",
        "jsonPath": ".status.cliffBatchSize",
        "description": "First batch size where speculation stops paying",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

_DROPPED_KEYS = {"title"}


def _model_classes() -> dict[str, type[BaseModel]]:
    return {
        name: obj
        for name, obj in vars(models).items()
        if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == models.__name__
    }


def _factory_defaults(cls: type[BaseModel]) -> dict[str, Any]:
    """Defaults made by default_factory, which pydantic leaves out of the JSON Schema.

    A nested object defaults to what its factory sets beyond its own fields' defaults (usually `{}`), and
    the API server fills in the rest."""
    out: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        if field.default_factory is None:
            continue
        value = field.default_factory()  # type: ignore[call-arg]
        if isinstance(value, BaseModel):
            value = value.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        out[field.alias or name] = value
    return out


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
        if len(options) != 1:
            raise ValueError(f"cannot express a union in a structural schema: {options}")
        inner = options[0]
        if "$ref" in inner:
            inner = {**defs[inner["$ref"].rsplit("/", 1)[-1]]}
        node = {**inner, **node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROPPED_KEYS:
            continue
        if key == "additionalProperties" and value is False:
            continue
        if key == "default" and value is None:
            continue
        if key == "exclusiveMinimum" and not isinstance(value, bool):
            out["minimum"], out["exclusiveMinimum"] = value, True
            continue
        if key == "exclusiveMaximum" and not isinstance(value, bool):
            out["maximum"], out["exclusiveMaximum"] = value, True
            continue
        if key == "const":
            out["enum"] = [value]
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
            continue
        if key in ("items", "additionalProperties"):
            out[key] = _structural(value, defs)
            continue
        out[key] = value
    return out


def _schema_of(cls: type[BaseModel]) -> dict[str, Any]:
    raw = cls.model_json_schema(by_alias=True, mode="validation")
    defs: dict[str, Any] = dict(raw.pop("$defs", {}))
    classes = _model_classes()
    defs[cls.__name__] = raw
    for name, schema in defs.items():
        if name in classes:
            for field, default in _factory_defaults(classes[name]).items():
                schema["properties"][field].setdefault("default", default)
    return _structural(raw, defs)


def open_api_schema() -> dict[str, Any]:
    """The CRD's openAPIV3Schema."""
    return {
        "type": "object",
        "description": "A model served by vLLM pods whose speculative decoding specserve controls live.",
        "required": ["spec"],
        "x-kubernetes-validations": [
            {
                "rule": f"size(self.metadata.name) <= {models.MAX_NAME_LENGTH}",
                "message": f"metadata.name must be at most {models.MAX_NAME_LENGTH} characters "
                "(children add suffixes)",
                "fieldPath": ".metadata.name",
            }
        ],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _schema_of(models.SpeculativeServingSpec),
            "status": _schema_of(models.SpeculativeServingStatus),
        },
    }


def build_crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "specserve"}},
        "spec": {
            "group": models.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": models.KIND,
                "listKind": f"{models.KIND}List",
                "plural": models.PLURAL,
                "singular": models.SINGULAR,
                "shortNames": list(models.SHORT_NAMES),
                "categories": ["specserve"],
            },
            "versions": [
                {
                    "name": models.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": open_api_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }


def crd_yaml() -> str:
    header = "# Generated by `specserve crd` from operator/specserve_operator/api/models.py: do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=True, width=100, allow_unicode=True)


def write_crds(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CRD_FILE_NAME
    path.write_text(crd_yaml())
    return path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("crd", help="print the SpeculativeServing CRD (or write it with --write)")
    parser.add_argument("--write", metavar="DIR", type=Path, help=f"write {CRD_FILE_NAME} into DIR")
    parser.add_argument("--reference", action="store_true", help="print the field reference (Markdown)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.reference:
        from specserve_operator.api.reference import reference_markdown

        sys.stdout.write(reference_markdown())
    elif args.write is not None:
        print(write_crds(args.write))
    else:
        sys.stdout.write(crd_yaml())
    return 0
