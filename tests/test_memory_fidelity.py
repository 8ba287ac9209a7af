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
        "-12%: its TF32 matmuls ([8192, 768..3072] x 768) run below the h100 preset's flat 0.7 x peak "
        "(the measured H100 profile: 227 TF/s at 8192x8192x1024, 346 assumed); the preset has no per-shape "
        "matmul efficiency, which would also move the cases that pass and needs more measurements"),
    "gpt-350m-bfloat16-b8": (
        "-11%: the same cause in bf16 (447 TF/s measured at 8192x8192x1024, 693 assumed)"),
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
