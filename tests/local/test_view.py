"""The live view renders what the fleet is doing (drawn to a string, no terminal needed)."""

from __future__ import annotations

from rich.console import Console

from specserve_operator.local.loadgen import LoadProgress
from specserve_operator.local.samples import DecisionRecord, FleetSample, PodSample
from specserve_operator.local.traffic import parse_pattern
from specserve_operator.local.view import ViewState, render


def _draw(state: ViewState) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(render(state))
    return console.export_text()


def test_view_shows_pods_decisions_and_progress() -> None:
    pattern = parse_pattern("quiet:10:1,busy:20:8,quiet:10:1")
    table = {"1": 4, "2": 4, "4": 2, "8": 0, "+Inf": 0}
    pods = (
        PodSample("tiny-0", 8.0, 512.5, 2.31, "ngram", "on", table, 7, (1, 2, 4, 8)),
        PodSample("tiny-1", None, None, None, None, None),
    )
    state = ViewState(
        title="specserve local fleet: local/tiny",
        stage="run specserve",
        sample=FleetSample("specserve", 15.0, 1, "busy", 8, 8, pods),
        progress=LoadProgress("specserve", 15.0, 40.0, "busy", 8, 8, 120, 1, 6400),
        pattern=pattern,
        decisions=[DecisionRecord("specserve", 12.0, "*", "disable", "bucket 8 off: k=0 gain 0.93")],
        messages=["engine tiny-0 ready"],
    )
    text = _draw(state)
    assert "tiny-0" in text and "512.5" in text and "2.31" in text and "ngram" in text
    assert "1:4 2:4 4:2 8:0 +Inf:0" in text and "K=0" in text  # batch 8 is past the cliff
    assert "v7" in text
    assert "unreachable" in text  # tiny-1's sidecar did not answer
    assert "bucket 8 off" in text and "disable" in text
    assert "busy×8" in text and "15/40s" in text and "failed 1" in text


def test_view_before_any_traffic() -> None:
    text = _draw(ViewState(title="t", stage="starting 1 engine(s)"))
    assert "starting 1 engine(s)" in text and "no traffic yet" in text
