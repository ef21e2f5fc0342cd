"""The real-Prometheus launcher that tests and the local fleet share."""

from __future__ import annotations

import json
import socket
import time
import urllib.parse
import urllib.request

import pytest

from specserve_operator.local.prometheus import PrometheusError, PrometheusProcess, scrape_config


def _query(url: str, expr: str, at: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr, "time": f"{at:.0f}"})
    with urllib.request.urlopen(f"{url}/api/v1/query?{q}", timeout=5) as resp:
        return json.load(resp)["data"]["result"]


def test_backfilled_history_is_served(prometheus_factory) -> None:
    now = time.time()
    lines = ["# TYPE demo_requests counter"]
    lines += [f'demo_requests_total{{pod="a"}} {i * 10} {now - 900 + i * 30:.0f}' for i in range(20)]
    prom = prometheus_factory(openmetrics="\n".join(lines) + "\n# EOF\n")
    result = _query(prom.url, "rate(demo_requests_total[5m])", now - 400)
    assert result and result[0]["metric"]["pod"] == "a"
    assert float(result[0]["value"][1]) == pytest.approx(10 / 30)


def test_scrapes_a_live_target_and_stops_cleanly(prometheus_factory) -> None:
    prom = prometheus_factory()
    scraper = PrometheusProcess(scrape_configs=[scrape_config("self", [f"127.0.0.1:{prom.port}"])])
    with scraper:
        scraper.wait_scraped(timeout_s=20)
        # The target answered; its sample is queryable within moments (queried a second ahead, since
        # _query rounds the time to the second, which could fall before the first sample).
        deadline = time.time() + 5
        while time.time() < deadline and not _query(scraper.url, 'up{job="self"} == 1', time.time() + 1):
            time.sleep(0.2)
        assert _query(scraper.url, 'up{job="self"} == 1', time.time() + 1)
        port = scraper.port
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # nothing listens any more
        s.connect(("127.0.0.1", port))


def test_a_taken_port_is_reported(prometheus_factory) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(PrometheusError, match="port"):
            PrometheusProcess(port=s.getsockname()[1]).start(timeout_s=20)


def test_waiting_for_a_target_that_does_not_answer_names_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: connection refused
        dead = f"127.0.0.1:{s.getsockname()[1]}"
        with (
            PrometheusProcess(scrape_configs=[scrape_config("dead", [dead])]) as prom,
            pytest.raises(PrometheusError, match=f"{dead}/metrics: down"),
        ):
            prom.wait_scraped(timeout_s=10)


def test_a_prometheus_that_exits_while_targets_are_awaited_is_reported_at_once() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # never answers: the wait would run its whole timeout
        dead = f"127.0.0.1:{s.getsockname()[1]}"
        with PrometheusProcess(scrape_configs=[scrape_config("dead", [dead])]) as prom:
            assert prom._group is not None
            prom._group.kill()
            started = time.monotonic()
            with pytest.raises(PrometheusError, match="prometheus exited with code"):
                prom.wait_scraped(timeout_s=60)
            assert time.monotonic() - started < 30  # not the 60 s timeout
