"""`specserve local up`'s options: what they set, and the values refused before anything starts."""

from __future__ import annotations

import pytest

from specserve_operator.cli import build_parser
from specserve_operator.local.cli import options_from_args
from specserve_operator.local.errors import LocalFleetError


def _options(*flags: str):
    return options_from_args(build_parser().parse_args(["local", "up", "examples/local-fleet.yaml", *flags]))


def test_the_sweep_runs_in_two_rounds_unless_told_otherwise() -> None:
    assert _options().sweep_rounds == 2
    assert _options("--sweep-rounds", "3", "--sweep-point", "4").sweep_rounds == 3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--sweep-rounds", "0"), "--sweep-rounds: must be at least 1"),
        (("--sweep-point", "inf"), "--sweep-point: must be a positive number of seconds"),
        (("--sweep-point", "-1"), "--sweep-point: must be a positive number of seconds"),
        (("--compare", "off,bogus"), "--compare: unknown run 'bogus'"),
        (("--compare-scale", "0"), "--compare-scale: must be > 0"),
    ],
)
def test_bad_options_are_refused_with_what_is_wrong(flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(LocalFleetError, match=message.replace("+", r"\+")):
        _options(*flags)
