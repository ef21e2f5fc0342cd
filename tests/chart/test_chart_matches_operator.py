"""The chart and the operator agree: the arguments the chart passes parse with the real `specserve`
command line, the environment it sets is what the operator reads, and the NetworkPolicy selects the
pods and the port the operator renders."""

from __future__ import annotations

import pytest
import yaml
from chart.helm import CHART, CI_VALUES, MONITORING_API, one, render

from specserve_engine.api import SidecarConfig
from specserve_operator import cli, reconciler
from specserve_operator.render import children


def _container(objects: list[dict]) -> dict:
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.name)
def test_chart_arguments_parse_with_the_operator_command_line(values: object) -> None:
    container = _container(render(values=[values]))
    args = cli.build_parser().parse_args(container["args"])
    assert args.command == "operator"
    assert args.liveness == f"http://0.0.0.0:{container['ports'][0]['containerPort']}/healthz"
    rendered = render(values=[values])
    peerings = [o for o in rendered if o["kind"] in {"ClusterKopfPeering", "KopfPeering"}]
    if args.standalone:
        assert not peerings
    else:
        assert {p["metadata"]["name"] for p in peerings} == {args.peering}
        namespaced = {p["metadata"].get("namespace") for p in peerings}
        assert namespaced == (set(args.namespace) if args.namespace else {None})


def test_cluster_wide_means_no_namespace_argument() -> None:
    args = cli.build_parser().parse_args(_container(render())["args"])
    assert args.namespace == [] and not args.standalone and not args.verbose


def test_engine_settings_reach_the_operators_render_options() -> None:
    container = _container(render(values=[CHART / "ci" / "hardened-values.yaml"]))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    options = reconciler.render_options_from_env(env)
    assert options == children.RenderOptions(
        s3_image="registry.example.com/tools/aws-cli:2.22.35",
        engine_image="registry.example.com/ml/specserve-engine@sha256:" + "fedcba9876543210" * 4,
        hf_token_secret="hf-token",
        s3_credentials_secret="s3-credentials",
        service_monitor_labels={"release": "kube-prometheus-stack", "team": "ml-platform"},
        scrape_interval="10s",
    )


def test_default_engine_settings_are_the_operators_defaults_and_the_charts_engine_image() -> None:
    container = _container(render())
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    assert reconciler.render_options_from_env(env) == children.RenderOptions(
        engine_image=f"ghcr.io/specserve/specserve-engine:{app_version}"
    )


def test_an_empty_engine_repository_gives_the_operator_no_default_image() -> None:
    container = _container(render("--set", "engines.image.repository="))
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    assert reconciler.render_options_from_env(env).engine_image is None


def test_network_policy_selects_the_engine_pods_and_the_sidecar_port() -> None:
    policy = one(render("--set", "networkPolicy.enabled=true", *MONITORING_API), "NetworkPolicy")
    selector = policy["spec"]["podSelector"]["matchLabels"]
    assert selector.items() <= children.common_labels("any-serving").items()
    port = policy["spec"]["ingress"][0]["ports"][0]["port"]
    assert port == children.SIDECAR_PORT == SidecarConfig.model_fields["port"].default
