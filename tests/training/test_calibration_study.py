"""The calibration study's own rules (scripts/calibration_study.py), on synthetic report rows.
The study itself is a script, not a test; its methods that do not run probes are rules over
the warm-up's report rows, and those are checked here."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "calibration_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("calibration_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _warm_up(study, ratios: dict[str, float]):
    """Report rows of a warm-up whose parts moved at `ratios` (update / weight) throughout."""
    rows = [{"kind": "report", "step": step, "part": part, "update_ratio": ratio,
             "layer_sizes": [4, 4]}
            for step in (5, 10, 15) for part, ratio in ratios.items()]

    def probe(*args, **kwargs):
        raise AssertionError("a rule over report rows runs no probes")

    return study.WarmUp(rows, probe)


SLOTS = ("token", "attention", "head")
RATIOS = {"token": 1e-4, "blocks[0].attention.wq": 4e-3, "blocks[0].attention.wo": 4e-3,
          "head": 1e-3}


def test_the_report_rule_brings_every_slot_to_the_target_ratio(study):
    chosen = study.METHODS["report_rule"](_warm_up(study, RATIOS), 3e-3, SLOTS)
    assert chosen == pytest.approx({"token": 10.0, "attention": 0.25, "head": 1.0})


def test_rebalance_keeps_the_global_rate_and_only_moves_the_balance(study):
    chosen = study.METHODS["rebalance"](_warm_up(study, RATIOS), 3e-3, SLOTS)
    rule = study.METHODS["report_rule"](_warm_up(study, RATIOS), 3e-3, SLOTS)
    # the geometric mean of the multipliers is 1: the user's rate is not lowered or raised
    assert math.prod(chosen.values()) == pytest.approx(1.0)
    # and the ratios between slots are the rule's
    assert chosen["token"] / chosen["head"] == pytest.approx(rule["token"] / rule["head"])
    assert chosen["attention"] / chosen["head"] == pytest.approx(
        rule["attention"] / rule["head"])
    assert study.METHODS["rebalance"](_warm_up(study, {}), 3e-3, SLOTS) == {}


def test_none_and_the_fixed_controls(study):
    warm_up = _warm_up(study, RATIOS)
    assert study.METHODS["none"](warm_up, 3e-3, SLOTS) == {}
    for name, factor in (("x0.5", 0.5), ("x8", 8.0), ("x32", 32.0)):
        assert study.METHODS[name](warm_up, 3e-3, SLOTS) == dict.fromkeys(SLOTS, factor)
    assert set(study.DEFAULT_METHODS) <= set(study.METHODS)
