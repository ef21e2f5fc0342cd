"""The Helm chart, rendered and linted by the real helm: objects and their settings for the default and
the ci/ values, the values schema's refusals, monitoring objects only with the Prometheus Operator's
API, and every built-in object valid for Kubernetes (kubernetes-validate)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from chart.helm import CHART, CI_VALUES, MONITORING_API, HelmError, find, helm, one, render

KUBERNETES_VERSION = "1.30.0"
BUILTIN_GROUPS = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1", "policy/v1"}
BUILTIN_GROUPS |= {"apiextensions.k8s.io/v1"}
FILES = CHART / "files"


def _chart_yaml() -> dict:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def _operator_container(objects: list[dict]) -> dict:
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


# --- lint ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_helm_lint_strict(values: Path | None) -> None:
    args = ["-f", values] if values else []
    result = helm("lint", "--strict", CHART, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_ci_values_cover_the_options() -> None:
    names = {p.name for p in CI_VALUES}
    assert {"default-values.yaml", "namespaced-values.yaml", "hardened-values.yaml"} <= names


# --- defaults --------------------------------------------------------------------------------------
def test_default_objects() -> None:
    objects = render()
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == sorted(
        ["CustomResourceDefinition"] * len(find(objects, "CustomResourceDefinition"))
        + ["ServiceAccount", "ClusterRole", "ClusterRole", "ClusterRoleBinding", "ClusterRoleBinding"]
        + ["Service", "Deployment", "ClusterKopfPeering"]
    )
    for o in objects:
        if o["kind"] != "CustomResourceDefinition":
            assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specserve", o["kind"]


def test_operator_deployment_defaults() -> None:
    objects = render()
    deployment = one(objects, "Deployment", "specserve")
    assert deployment["metadata"]["namespace"] == "specserve"
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = _operator_container(objects)
    assert container["image"] == f"ghcr.io/specserve/specserve-operator:{_chart_yaml()['appVersion']}"
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["privileged"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}
    assert container["resources"]["limits"] and container["resources"]["requests"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"health": 8080, "metrics": 9095}
    for probe in (container["livenessProbe"], container["readinessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["args"] == ["operator", "--liveness=http://0.0.0.0:8080/healthz", "--peering=specserve"]
    assert _env(container)["SPECSERVE_PROMETHEUS_URL"] == "http://prometheus-operated.monitoring.svc:9090"
    service = one(objects, "Service")
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"][0]["targetPort"] == "metrics"


def test_selector_labels_match_the_pod_template() -> None:
    deployment = one(render(), "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


# --- RBAC ------------------------------------------------------------------------------------------
def _rules(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def test_rbac_is_least_privilege() -> None:
    objects = render()
    main = _rules(one(objects, "ClusterRole", "specserve"))
    cluster = _rules(one(objects, "ClusterRole", "specserve-cluster"))
    for role in (main, cluster):
        for (group, resource), verbs in role.items():
            assert "*" not in verbs and group != "*" and resource != "*", (group, resource)
    assert main[("specserve.io", "speculativeservings")] == {"get", "list", "watch", "patch"}
    assert main[("specserve.io", "speculativeservings/status")] == {"patch"}
    # no Secrets cluster-wide: only Roles in operator.secretNamespaces grant them (none by default)
    assert ("", "secrets") not in main and ("", "secrets") not in cluster
    assert not find(objects, "Role")
    assert main[("", "events")] == {"create"}
    assert cluster[("kopf.dev", "clusterkopfpeerings")] == {"get", "list", "watch", "patch"}
    assert cluster[("apiextensions.k8s.io", "customresourcedefinitions")] == {"list", "watch"}
    # Nothing beyond the operator's own objects: no nodes, no RBAC, no escalation.
    groups = {group for group, _ in main} | {group for group, _ in cluster}
    assert groups <= {"", "apps", "policy", "specserve.io", "monitoring.coreos.com", "kopf.dev"} | {
        "apiextensions.k8s.io"
    }
    bindings = find(objects, "ClusterRoleBinding")
    assert {b["roleRef"]["name"] for b in bindings} == {"specserve", "specserve-cluster"}
    for binding in bindings:
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "specserve", "namespace": "specserve"}
        ]


def test_watched_namespaces_get_role_bindings_and_namespaced_peerings() -> None:
    objects = render(values=[CHART / "ci" / "namespaced-values.yaml"])
    bindings = [b for b in find(objects, "RoleBinding") if b["roleRef"]["kind"] == "ClusterRole"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["inference", "research"]
    assert all(
        b["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "specserve"}
        for b in bindings
    )
    # Secrets through a Role in each watched namespace (tests/chart/test_rbac_matches_code.py)
    secret_roles = find(objects, "Role", "specserve-secrets")
    assert sorted(r["metadata"]["namespace"] for r in secret_roles) == ["inference", "research"]
    # The namespaced permissions are not granted cluster-wide.
    assert [b["roleRef"]["name"] for b in find(objects, "ClusterRoleBinding")] == ["specserve-cluster"]
    peerings = find(objects, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["inference", "research"]
    assert not find(objects, "ClusterKopfPeering")
    assert ("kopf.dev", "kopfpeerings") in _rules(one(objects, "ClusterRole", "specserve"))
    assert ("kopf.dev", "clusterkopfpeerings") not in _rules(one(objects, "ClusterRole", "specserve-cluster"))
    container = _operator_container(objects)
    assert "--namespace=inference" in container["args"] and "--namespace=research" in container["args"]
    assert "--verbose" in container["args"]
    assert _env(container)["SPECSERVE_PROMETHEUS_URL"] == "https://prometheus.monitoring.svc:9091"
    assert one(objects, "Deployment")["spec"]["replicas"] == 2
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"] == one(objects, "Deployment")["spec"]["selector"]


def test_without_peering_the_operator_runs_standalone() -> None:
    objects = render(values=[CHART / "ci" / "hardened-values.yaml"])
    container = _operator_container(objects)
    assert "--standalone" in container["args"]
    assert not any(a.startswith("--peering") for a in container["args"])
    assert not find(objects, "ClusterKopfPeering") and not find(objects, "KopfPeering")
    assert ("kopf.dev", "clusterkopfpeerings") not in _rules(one(objects, "ClusterRole", "specserve-cluster"))
    assert container["image"].endswith("@sha256:" + "0123456789abcdef" * 4)
    assert one(objects, "ServiceAccount")["metadata"]["name"] == "specserve-operator"


def test_a_private_ca_for_an_https_prometheus_is_mounted_and_named() -> None:
    """The reader verifies an https Prometheus (docs/install.md): a private CA comes in through the
    extra volumes and REQUESTS_CA_BUNDLE, beside the chart's own /tmp, the root filesystem read-only."""
    objects = render(values=[CHART / "ci" / "hardened-values.yaml"])
    container = _operator_container(objects)
    assert _env(container)["SPECSERVE_PROMETHEUS_URL"].startswith("https://")
    assert _env(container)["REQUESTS_CA_BUNDLE"] == "/etc/specserve/ca/ca.crt"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert set(mounts) == {"/tmp", "/etc/specserve/ca"} and mounts["/etc/specserve/ca"]["readOnly"] is True
    volumes = {v["name"]: v for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["prometheus-ca"] == {"name": "prometheus-ca", "configMap": {"name": "prometheus-ca"}}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


# --- NetworkPolicy ---------------------------------------------------------------------------------
def test_network_policy_admits_only_the_operator_to_the_control_port() -> None:
    objects = render(values=[CHART / "ci" / "hardened-values.yaml"])
    policy = one(objects, "NetworkPolicy")
    assert policy["metadata"]["namespace"] == "inference"
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    control, others = spec["ingress"]
    assert control["ports"] == [{"protocol": "TCP", "port": 8081}]
    operator_peer = control["from"][0]
    assert operator_peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "specserve"}
    assert (
        operator_peer["podSelector"]["matchLabels"]
        == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    )
    assert control["from"][1]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }
    # Every other port is open to all, and the control port is in neither range.
    assert "from" not in others
    assert others["ports"] == [
        {"protocol": "TCP", "port": 1, "endPort": 8080},
        {"protocol": "TCP", "port": 8082, "endPort": 65535},
    ]


def test_network_policy_defaults_to_the_release_namespace_and_is_off_by_default() -> None:
    assert not find(render(), "NetworkPolicy")
    policy = one(
        render("--set", "networkPolicy.enabled=true", "--set", "networkPolicy.sidecarPort=9000"),
        "NetworkPolicy",
    )
    assert policy["metadata"]["namespace"] == "specserve"
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9000}]


# --- monitoring --------------------------------------------------------------------------------------
MONITORING_KINDS = {"ServiceMonitor", "PrometheusRule"}


def test_monitoring_objects_only_with_the_prometheus_operator_api() -> None:
    without = render()
    assert not {o["kind"] for o in without} & MONITORING_KINDS
    assert not find(without, "ConfigMap")
    with_api = render(*MONITORING_API)
    assert {o["kind"] for o in with_api} >= MONITORING_KINDS
    assert len(find(with_api, "ConfigMap")) == len(list((FILES / "dashboards").glob("*.json")))
    disabled = render(
        *MONITORING_API,
        "--set", "monitoring.serviceMonitor.enabled=false",
        "--set", "monitoring.prometheusRule.enabled=false",
        "--set", "monitoring.dashboards.enabled=false",
    )  # fmt: skip
    assert not {o["kind"] for o in disabled} & MONITORING_KINDS and not find(disabled, "ConfigMap")


def test_prometheus_rule_embeds_the_rules_file_unchanged() -> None:
    rule = one(render(*MONITORING_API), "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((FILES / "rules.yaml").read_text())


def test_prometheus_rule_runbook_base_url_and_labels() -> None:
    objects = render(*MONITORING_API, values=[CHART / "ci" / "hardened-values.yaml"])
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    urls = [
        r["annotations"]["runbook_url"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r
    ]
    assert urls and all(u.startswith("https://wiki.example.com/specserve/runbook#specserve") for u in urls)
    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "honorLabels": True}
    ]
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= one(objects, "Service")["metadata"]["labels"].items()
    )


def test_dashboard_config_maps_carry_the_grafana_label_and_the_json() -> None:
    objects = render(*MONITORING_API)
    maps = find(objects, "ConfigMap")
    shipped = {p.name: json.loads(p.read_text()) for p in (FILES / "dashboards").glob("*.json")}
    seen = {}
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == "specserve"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "specserve"}
        for key, text in config_map["data"].items():
            seen[key] = json.loads(text)
    assert seen == shipped
    moved = find(render(*MONITORING_API, values=[CHART / "ci" / "hardened-values.yaml"]), "ConfigMap")
    assert {m["metadata"]["namespace"] for m in moved} == {"monitoring"}


# --- the values schema -----------------------------------------------------------------------------
BAD_VALUES = [
    (["--set", "replicas=0"], "/replicas"),
    (["--set", "peering.enabled=false", "--set", "replicas=2"], "/replicas"),
    (["--set", "replicaCount=2"], "replicaCount"),
    (["--set", "operator.prometheusURL=http://x"], "prometheusURL"),
    (["--set", "operator.prometheusUrl=prometheus:9090"], "/operator/prometheusUrl"),
    (["--set", "operator.healthPort=0"], "/operator/healthPort"),
    (["--set", "operator.verbose=sometimes"], "/operator/verbose"),
    (["--set", "engines.hfTokenSecret=Bad_Name"], "/engines/hfTokenSecret"),
    (["--set", "engines.scrapeInterval=fast"], "/engines/scrapeInterval"),
    (["--set", "operator.watchNamespaces[0]=Not_A_Namespace"], "/operator/watchNamespaces/0"),
    (["--set", "image.pullPolicy=Sometimes"], "/image/pullPolicy"),
    (["--set", "image.digest=latest"], "/image/digest"),
    (["--set", "networkPolicy.sidecarPort=70000"], "/networkPolicy/sidecarPort"),
    (["--set", "networkPolicy.enabled=yes"], "/networkPolicy/enabled"),
    (["--set", "monitoring.serviceMonitor.interval=often"], "/monitoring/serviceMonitor/interval"),
    (["--set", "monitoring.dashboards.grafanaFolder=x"], "grafanaFolder"),
    (["--set", "resources.limits.gpu=1"], "gpu"),
    (["--set", "podDisruptionBudget.minAvailable=half"], "/podDisruptionBudget/minAvailable"),
]


@pytest.mark.parametrize(("args", "field"), BAD_VALUES, ids=[f for _, f in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_field(args: list[str], field: str) -> None:
    with pytest.raises(HelmError) as error:
        render(*args)
    assert "values don't meet the specifications of the schema" in str(error.value)
    assert field in str(error.value)


def test_schema_is_strict_everywhere() -> None:
    """Every object in the schema forbids unknown keys, except the free-form Kubernetes passthroughs."""
    free_form = {
        "affinity",
        "tolerations",
        "extraEnv",
        "extraVolumes",
        "extraVolumeMounts",
        "sidecarPortFrom",
        "global",
    }
    schema = json.loads((CHART / "values.schema.json").read_text())

    def walk(node: dict, name: str) -> None:
        if node.get("type") == "object" and "properties" in node and name not in free_form:
            assert node.get("additionalProperties") is False, name
        for key, child in node.get("properties", {}).items():
            walk(child, key)

    walk(schema, "(root)")
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(defaults) <= set(schema["properties"])


# --- every object valid ----------------------------------------------------------------------------
RENDERINGS = {
    "defaults": [],
    "monitoring": list(MONITORING_API),
    **{p.stem: ["-f", str(p), *MONITORING_API] for p in CI_VALUES},
}


@pytest.mark.parametrize("args", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_every_builtin_object_is_valid_kubernetes(args: list[str]) -> None:
    checked = 0
    for obj in render(*args):
        if obj["apiVersion"] in BUILTIN_GROUPS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
            checked += 1
    assert checked >= 8


@pytest.mark.parametrize("args", RENDERINGS.values(), ids=RENDERINGS.keys())
def test_custom_objects_match_their_crds(args: list[str]) -> None:
    objects = render(*args)
    crds = {
        (c["spec"]["group"], c["spec"]["names"]["kind"]): c for c in find(objects, "CustomResourceDefinition")
    }
    for obj in objects:
        group = obj["apiVersion"].split("/")[0]
        if obj["apiVersion"] in BUILTIN_GROUPS or group == "monitoring.coreos.com":
            continue
        crd = crds[(group, obj["kind"])]
        scope = crd["spec"]["scope"]
        assert ("namespace" in obj["metadata"]) == (scope == "Namespaced"), obj["kind"]
    for monitor in find(objects, "ServiceMonitor"):
        assert monitor["spec"]["selector"]["matchLabels"] and monitor["spec"]["endpoints"]
    for rule in find(objects, "PrometheusRule"):
        for group in rule["spec"]["groups"]:
            assert group["name"] and all(
                ("alert" in r) != ("record" in r) and r["expr"] for r in group["rules"]
            )


# --- CRDs --------------------------------------------------------------------------------------------
def test_chart_crds_are_the_top_level_crds() -> None:
    """crds/ (generated from the API models) and the chart's crds/ hold the same files. The chart adds
    kopf's peering CRDs, unless the top-level folder carries them too (then they must be identical)."""
    top = {p.name: p.read_text() for p in (CHART.parents[1] / "crds").glob("*.yaml")}
    chart = {p.name: p.read_text() for p in (CHART / "crds").glob("*.yaml")}
    chart_only = set(chart) - set(top)
    assert chart_only <= {"kopf-peering.yaml"}, f"chart CRDs missing from crds/: {chart_only}"
    for name, text in top.items():
        assert chart.get(name) == text, f"charts/specserve/crds/{name} differs from crds/{name}: copy it"


def test_crds_are_rendered_before_everything_else() -> None:
    objects = render()
    names = {c["metadata"]["name"] for c in find(objects, "CustomResourceDefinition")}
    assert {"clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"} <= names
    kinds = [o["kind"] for o in objects]
    assert kinds[: len(names)] == ["CustomResourceDefinition"] * len(names)


def test_install_guide_documents_every_value() -> None:
    guide = (CHART.parents[1] / "docs" / "install.md").read_text()
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for key, value in defaults.items():
        keys = [f"{key}.{sub}" for sub in value] if isinstance(value, dict) and key != "resources" else [key]
        for dotted in keys:
            top, _, sub = dotted.partition(".")
            assert f"`{dotted}" in guide or (sub and f"`{top}.*`" in guide) or f"{top}.*" in guide, dotted


# A generated CRD's CEL rule can hold one long unbreakable word (a regular expression): allowed as a value.
YAMLLINT_CONFIG = """
extends: default
rules:
  line-length: {max: 150, allow-non-breakable-inline-mappings: true}
  document-start: disable
  truthy: {check-keys: false}
  comments: {min-spaces-from-content: 1}
  braces: {max-spaces-inside: 1}
  brackets: {max-spaces-inside: 1}
  indentation: {spaces: 2, indent-sequences: consistent}
"""


def test_chart_yaml_sources_pass_yamllint() -> None:
    """chart-testing's lint step: the chart's plain YAML (templates are Helm's to check)."""
    sources = [CHART / "Chart.yaml", CHART / "values.yaml", CHART / "ci", CHART / "files", CHART / "crds"]
    result = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "-d", YAMLLINT_CONFIG, *map(str, sources)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
