"""The planner's predictions against what XLA compiled and ran on one H100.

``tests/data/h100_fidelity.json`` holds, per case (an example model at a preset, dtype, batch and remat
setting), the compiled step's ``memory_analysis()`` and its measured step time on one H100 (jax 0.11.2,
2026-11-22; provenance in the file). Each test plans the same step here, on abstract shapes, on a
1-device mesh with the ``h100`` preset, and holds the prediction to the measurement: peak memory within
15% of XLA's (temp + arguments + outputs - aliased), step time within 10% of the measured median.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

import autoshard
from autoshard._examples import load_example

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((Path(__file__).parent / "data" / "h100_fidelity.json").read_text())
CASES = {f"{c['model']}-{c['preset']}-{c['dtype']}-b{c['batch']}{'-remat' if c['remat'] else ''}": c
         for c in DATA["cases"]}
MEMORY_TOLERANCE = 0.15
TIME_TOLERANCE = 0.10

# Cases the model cannot yet reach, each with the reason (strict: a fix that reaches them must say so).
TIME_XFAIL: dict[str, str] = {
    "gpt-125m-float32-b8": (
        "-12%, not from matmul rates: the same H100's sweep of this step's matmul shapes (2026-11-26, "
        "benchmarks/data/gpu_truth_h100_2026-11-26.jsonl) priced per shape moves it to -10.2% only; the "
        "missing time is elsewhere (attention-score and elementwise traffic are the suspects; needs a GPU "
        "trace of the step)"),
    "gpt-350m-bfloat16-b8": (
        "-11%, not from matmul rates: priced with the measured per-shape rates it is -11.9% (the flat 0.7 x "
        "peak is within 5% of the measured rate for most of its shapes); same suspects as above"),
}
MEMORY_XFAIL: dict[str, str] = {}


@functools.cache
def _plan(name: str) -> Any:
    c = CASES[name]
    overrides = [f"dtype={c['dtype']}", f"batch={c['batch']}"] + (["remat=true"] if c["remat"] else [])
    ex = load_example(ROOT / "examples" / f"{c['model']}.py", c["preset"], overrides, abstract=True)
    return autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware="h100", time_budget_s=10)


def _params(xfail: dict[str, str]) -> list[Any]:
    return [pytest.param(n, marks=pytest.mark.xfail(reason=xfail[n], strict=True)) if n in xfail else n
            for n in CASES]


def test_the_data_file_says_where_it_comes_from() -> None:
    prov = DATA["provenance"]
    assert prov["date"] == "2026-11-22" and prov["jax"] == "0.11.2" and "H100" in prov["device"]
    assert prov["command"]
    for c in DATA["cases"]:  # XLA's peak is temp + arguments + outputs - aliased
        assert c["xla_peak_bytes"] == (c["xla_temp_bytes"] + c["xla_arg_bytes"] + c["xla_out_bytes"]
                                       - c["xla_alias_bytes"])


@pytest.mark.parametrize("name", _params(MEMORY_XFAIL))
def test_predicted_peak_memory_is_within_15_percent_of_xla(name: str) -> None:
    plan = _plan(name)
    xla = CASES[name]["xla_peak_bytes"]
    assert abs(plan.peak_memory - xla) <= MEMORY_TOLERANCE * xla, (
        f"{name}: predicted {plan.peak_memory / 1e9:.2f} GB, XLA {xla / 1e9:.2f} GB")


@pytest.mark.parametrize("name", _params(TIME_XFAIL))
def test_predicted_step_time_is_within_10_percent_of_the_measured(name: str) -> None:
    plan = _plan(name)
    measured = CASES[name]["jit_median_s"]
    assert abs(plan.predicted_step_time - measured) <= TIME_TOLERANCE * measured, (
        f"{name}: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured {measured * 1e3:.1f} ms")


# ---- recompute on the GPU: the planner's rewrite of the step, compiled by XLA (2026-11-26) --------------
# ``tests/data/h100_recompute_fidelity.json``: GPT steps with every block rewritten by autoshard's recompute
# (none / selective / full) and re-emitted for one H100, XLA's memory_analysis() and step time of each; and
# GPT-2.6B as written. Provenance in the file (benchmarks/gpu_truth.py).
RECOMPUTE = json.loads((Path(__file__).parent / "data" / "h100_recompute_fidelity.json").read_text())
RCASES = {f"{c['model']}-{c['preset']}-{'-'.join(c['overrides'])}-{c['recompute']}": c for c in RECOMPUTE["cases"]}


@functools.cache
def _recompute_plan(name: str) -> Any:
    c = RCASES[name]
    ex = load_example(ROOT / "examples" / f"{c['model']}.py", c["preset"], c["overrides"], abstract=True)
    return autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware="h100", time_budget_s=10,
                          recompute=c["recompute"])


def test_the_recompute_data_says_where_it_comes_from() -> None:
    prov = RECOMPUTE["provenance"]
    assert prov["date"] == "2026-11-26" and prov["jax"] == "0.11.2" and "H100" in prov["device"]
    for c in RECOMPUTE["cases"]:
        assert c["xla_peak_bytes"] == (c["xla_temp_bytes"] + c["xla_arg_bytes"] + c["xla_out_bytes"]
                                       - c["xla_alias_bytes"])


@pytest.mark.parametrize("name", list(RCASES))
def test_recompute_plans_predict_xla_memory_and_time(name: str) -> None:
    """Each mode's plan: the blocks it recomputes are the step's, its peak within 15% of XLA's for the
    program autoshard emits, its step time (recomputed forward included) within 10% of the measured."""
    c, plan = RCASES[name], _recompute_plan(name)
    assert set(plan.recompute.values()) == ({c["recompute"]} if c["recompute"] != "none" else set())
    xla = c["xla_peak_bytes"]
    assert abs(plan.peak_memory - xla) <= MEMORY_TOLERANCE * xla, (
        f"{name}: predicted {plan.peak_memory / 1e9:.2f} GB, XLA {xla / 1e9:.2f} GB")
    if c["median_s"] is not None:  # None: compiled, but ran out of memory on the device when run
        t = c["median_s"]
        assert abs(plan.predicted_step_time - t) <= TIME_TOLERANCE * t, (
            f"{name}: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured {t * 1e3:.1f} ms")


def test_recompute_lowers_predicted_and_real_peak_memory_and_costs_time() -> None:
    """Per model: none > selective > full in XLA's peak and in the planner's, and the reverse in time."""
    groups: dict[str, dict[str, str]] = {}
    for name, c in RCASES.items():
        groups.setdefault(name.rsplit("-", 1)[0], {})[c["recompute"]] = name
    compared = 0
    for modes in groups.values():
        order = [modes[m] for m in ("none", "selective", "full") if m in modes]
        if len(order) < 2:
            continue
        compared += 1
        real = [RCASES[n]["xla_peak_bytes"] for n in order]
        predicted = [_recompute_plan(n).peak_memory for n in order]
        assert real == sorted(real, reverse=True) and predicted == sorted(predicted, reverse=True), order
        timed = [n for n in order if RCASES[n]["median_s"] is not None]
        assert [RCASES[n]["median_s"] for n in timed] == sorted(RCASES[n]["median_s"] for n in timed)
        assert [_recompute_plan(n).predicted_step_time for n in timed] == sorted(
            _recompute_plan(n).predicted_step_time for n in timed)
    assert compared == 3
