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


def _name(c: dict[str, Any]) -> str:
    return f"{c['model']}-{c['preset']}-{c['dtype']}-b{c['batch']}{'-remat' if c['remat'] else ''}"


CASES = {_name(c): c for c in DATA["cases"]}
MEMORY_TOLERANCE = 0.15
TIME_TOLERANCE = 0.10

# Cases the model cannot yet reach, each with the reason (strict: a fix that reaches them must say so).
TIME_XFAIL: dict[str, str] = {
    "gpt-125m-float32-b8": (
        "-12% of the step timed with a wait after every step, which includes host time: a profiler trace "
        "on the H100 (2026-11-26, benchmarks/data/traces_h100_2026-11-26) shows the GPU's kernels take "
        "57.4 ms a step back to back, 3.5% from the prediction (held below); the rest is host time per "
        "synchronised step, which the plan does not price"),
    "gpt-350m-bfloat16-b8": (
        "-11% of the synchronised step: the GPU's kernels take 75.3 ms a step back to back (profiler "
        "trace, 1,840 kernels a step); the prediction is 2.7% over that (held below); the synchronised step "
        "adds ~9 ms of host time (dispatch and the CUDA graph's update) that the plan does not price"),
    "gpt-1.3b-bfloat16-b4": (
        "-11% of the synchronised step (106.2 ms against 119.3 ms) since dead code is priced at zero "
        "(trace.buffers.dead_ops, XLA's DCE): the residuals of jnp.where's and reduce_max's linearisation "
        "that nothing reads, a float32 [4, 32, 1024, 1024] zeros and the max's tie mask and count, were "
        "4.9 ms of the old 111.1 ms; the case has no back-to-back GPU time to separate host time from"),
    "moe-380m-float32-b8": (
        "-11.5% of the synchronised step (62.0 ms against 70.1 ms) since dead code is priced at zero "
        "(trace.buffers.dead_ops: 1.9 ms of the old 63.9 ms); 7.3% under the GPU's back-to-back time "
        "(66.9 ms, held below), the synchronised step adding 2.8 ms of host time"),
}
MEMORY_XFAIL: dict[str, str] = {}


@functools.cache
def _case_plan(model: str, preset: str, dtype: str, batch: int, remat: bool, hardware: str) -> Any:
    overrides = [f"dtype={dtype}", f"batch={batch}"] + (["remat=true"] if remat else [])
    ex = load_example(ROOT / "examples" / f"{model}.py", preset, overrides, abstract=True)
    return autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware=hardware, time_budget_s=10)


def _plan(name: str, cases: dict[str, dict[str, Any]] = CASES, hardware: str = "h100") -> Any:
    c = cases[name]
    return _case_plan(c["model"], c["preset"], c["dtype"], c["batch"], c["remat"], hardware)


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


# ---- step time with the host out of the way (2026-11-26) -----------------------------------------------
# ``tests/data/h100_back_to_back.json``: six of the cases above re-timed on one H100 with steps dispatched
# back to back (and from a profiler trace of the GPU's kernels). The plan prices the GPU's work; a loop that
# waits on every step adds 1.7-8.7 ms of host time per step (dispatch and the update of the step's CUDA
# graph) which a loop that does not wait hides.
BACK_TO_BACK = json.loads((Path(__file__).parent / "data" / "h100_back_to_back.json").read_text())
B2B = {_name(c): c for c in BACK_TO_BACK["cases"]}


@pytest.mark.parametrize("name", list(B2B))
def test_predicted_step_time_is_within_10_percent_of_the_gpu_time_back_to_back(name: str) -> None:
    t, plan = B2B[name]["back_to_back_s"], _plan(name)
    assert abs(plan.predicted_step_time - t) <= TIME_TOLERANCE * t, (
        f"{name}: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured back to back {t * 1e3:.1f} ms")


def test_back_to_back_steps_are_the_synced_steps_less_host_time() -> None:
    """The data's own consistency: dispatching back to back never makes a step slower, and the host time
    it hides is a few ms, not a different program."""
    for name, c in B2B.items():
        assert name in CASES
        hidden = c["synced_median_s"] - c["back_to_back_s"]
        assert 0 < hidden < 0.15 * c["synced_median_s"], name


# ---- recompute on the GPU (2026-11-26) -------------------------------------------------------------------
# ``tests/data/h100_recompute_fidelity.json``: GPT steps with every block rewritten by autoshard's recompute
# (none / selective / full) and re-emitted for one H100, XLA's memory_analysis() and step time of each; and
# GPT-2.6B as written. Provenance in the file (benchmarks/gpu_truth.py); the selective and full rows name the
# commit whose rewrite they measured (field ``rewrite``).
RECOMPUTE = json.loads((Path(__file__).parent / "data" / "h100_recompute_fidelity.json").read_text())
RCASES = {f"{c['model']}-{c['preset']}-{'-'.join(c['overrides'])}-{c['recompute']}": c for c in RECOMPUTE["cases"]}


@functools.cache
def _recompute_plan(model: str, preset: str, overrides: tuple[str, ...], recompute: str) -> Any:
    ex = load_example(ROOT / "examples" / f"{model}.py", preset, list(overrides), abstract=True)
    return autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware="h100", time_budget_s=10,
                          recompute=recompute)


def _rplan(name: str) -> Any:
    c = RCASES[name]
    return _recompute_plan(c["model"], c["preset"], tuple(c["overrides"]), c["recompute"])


def test_the_recompute_data_says_where_it_comes_from() -> None:
    prov = RECOMPUTE["provenance"]
    assert prov["date"] == "2026-11-26" and prov["jax"] == "0.11.2" and "H100" in prov["device"]
    assert prov["rewrite"] and all(("rewrite" in c) == (c["recompute"] != "none") for c in RECOMPUTE["cases"])
    for c in RECOMPUTE["cases"]:
        assert c["xla_peak_bytes"] == (c["xla_temp_bytes"] + c["xla_arg_bytes"] + c["xla_out_bytes"]
                                       - c["xla_alias_bytes"])


# the default run keeps one case of each recompute mode; the rest run with the slow tests (20-36 s each)
FAST_RCASES = {"gpt-1.3b-dtype=bfloat16-batch=8-selective", "gpt-760m-dtype=bfloat16-batch=8-full",
               "gpt-350m-dtype=float32-batch=8-none"}


@pytest.mark.parametrize("name", [n if n in FAST_RCASES else pytest.param(n, marks=pytest.mark.slow)
                                  for n in RCASES])
def test_emitted_steps_predict_xla_memory_and_time(name: str) -> None:
    """The step as autoshard emits it for one H100: peak within 15% of XLA's, time within 10% of the
    measured (rows whose run ran out of memory on the device have no time)."""
    c, plan = RCASES[name], _rplan(name)
    xla = c["xla_peak_bytes"]
    assert abs(plan.peak_memory - xla) <= MEMORY_TOLERANCE * xla, (
        f"{name}: predicted {plan.peak_memory / 1e9:.2f} GB, XLA {xla / 1e9:.2f} GB")
    if c["median_s"] is not None:
        t = c["median_s"]
        assert abs(plan.predicted_step_time - t) <= TIME_TOLERANCE * t, (
            f"{name}: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured {t * 1e3:.1f} ms")


def test_full_recompute_plan_matches_flax_remat_on_the_gpu() -> None:
    """GPT-1.3B bf16 batch 8 traced without remat and planned with ``recompute="full"`` recomputes every
    block, and its predicted peak and time are within 15% / 10% of the same step written with ``nn.remat``
    as XLA compiled and ran it (``h100_fidelity.json``): the rewrite does what flax's remat does."""
    case = CASES["gpt-1.3b-bfloat16-b8-remat"]
    plan = _recompute_plan("gpt", "1.3b", ("dtype=bfloat16", "batch=8"), "full")
    assert len(plan.recompute) == 24 and set(plan.recompute.values()) == {"full"}
    xla, t = case["xla_peak_bytes"], case["jit_median_s"]
    assert abs(plan.peak_memory - xla) <= MEMORY_TOLERANCE * xla, (
        f"predicted {plan.peak_memory / 1e9:.2f} GB, XLA with nn.remat {xla / 1e9:.2f} GB")
    assert abs(plan.predicted_step_time - t) <= TIME_TOLERANCE * t, (
        f"predicted {plan.predicted_step_time * 1e3:.1f} ms, measured with nn.remat {t * 1e3:.1f} ms")


def test_recompute_lowers_predicted_peak_memory_and_costs_time() -> None:
    """GPT-760M bf16 b8: none > selective > full in predicted peak, the reverse in predicted time; the step
    as traced matches the GPU (above), and recompute's plans name every block."""
    plans = [_recompute_plan("gpt", "760m", ("dtype=bfloat16", "batch=8"), m) for m in ("none", "selective", "full")]
    peaks = [p.peak_memory for p in plans]
    times = [p.predicted_step_time for p in plans]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > 2 * peaks[2]
    assert times == sorted(times)
    assert not plans[0].recompute and [set(p.recompute.values()) for p in plans[1:]] == [{"selective"}, {"full"}]


# ---- a second card: one H200 (2026-11-26) ----------------------------------------------------------------
# ``tests/data/h200_fidelity.json``: eight of the cases above and GPT-6.7B bf16 b2 (117.5 GB: too large for an
# H100), compiled and timed on one H200 (141 GB HBM3e at 4.8 TB/s, the H100's compute). Planned with the
# ``h200`` preset, whose memory efficiency (0.75) was fitted to these rows' back-to-back times; the memory
# rows were not fitted.
H200 = json.loads((Path(__file__).parent / "data" / "h200_fidelity.json").read_text())
H200_CASES = {_name(c): c for c in H200["cases"]}


def test_the_h200_data_says_where_it_comes_from_and_compiles_as_the_h100_did() -> None:
    """Provenance, and the bf16 steps that were also compiled for the H100 (2026-11-22) peak within 0.1% of
    what they did there: their buffer assignment is not the card's. The two fp32 steps do not (GPT-125M
    +6%, MoE-380M +10% on the H200; TF32 GEMM workspaces or the examples' changes since 11-22: not
    established), so the planner's one prediction for both cards is held to each card's own number."""
    prov = H200["provenance"]
    assert prov["date"] == "2026-11-26" and prov["jax"] == "0.11.2" and "H200" in prov["device"]
    assert prov["command"] and prov["calibration"]
    shared = [n for n in H200_CASES if n in CASES]
    assert len(shared) == 8
    for name, c in H200_CASES.items():
        assert c["xla_peak_bytes"] == (c["xla_temp_bytes"] + c["xla_arg_bytes"] + c["xla_out_bytes"]
                                       - c["xla_alias_bytes"])
        assert 0 < c["synced_median_s"] - c["back_to_back_s"] < 0.15 * c["synced_median_s"], name
        if name in CASES and c["dtype"] == "bfloat16":
            assert abs(c["xla_peak_bytes"] - CASES[name]["xla_peak_bytes"]) <= 1e-3 * c["xla_peak_bytes"], name


# The two fp32 steps were 7.0% and 9.7% under their back-to-back time with the preset fitted (0.75), and passed
# 10% once dead code was priced at zero (trace.buffers.dead_ops: the residuals of jnp.where's and reduce_max's
# linearisation that nothing reads, which XLA removes; the fit had absorbed them). The preset is not refitted
# in this change: a refit moves all nine rows, which spanned 0.90-1.09 of their times (``presets.h200``).
H200_TIME_XFAIL: dict[str, str] = {
    "gpt-125m-float32-b8": "45.7 ms predicted against 51.2 ms back to back (-10.7%; 47.6 ms with dead code priced)",
    "moe-380m-float32-b8": "54.4 ms predicted against 62.0 ms back to back (-12.3%; 55.9 ms with dead code priced)",
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=H200_TIME_XFAIL[n], strict=True))
                                  if n in H200_TIME_XFAIL else n for n in H200_CASES])
def test_h200_peak_memory_within_15_percent_and_time_within_10_percent_back_to_back(name: str) -> None:
    c, plan = H200_CASES[name], _plan(name, H200_CASES, "h200")
    xla, t = c["xla_peak_bytes"], c["back_to_back_s"]
    assert abs(plan.peak_memory - xla) <= MEMORY_TOLERANCE * xla, (
        f"{name}: predicted {plan.peak_memory / 1e9:.2f} GB, XLA {xla / 1e9:.2f} GB")
    assert abs(plan.predicted_step_time - t) <= TIME_TOLERANCE * t, (
        f"{name}: predicted {plan.predicted_step_time * 1e3:.1f} ms, measured back to back {t * 1e3:.1f} ms")
