"""Model FLOP utilization: model flops against the published GPT formula, loops, dtypes, plans."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.planner.plan import Plan
from autoshard.planner.summary import format_plan
from autoshard.planner.utilization import model_flops
from autoshard.trace import trace
from cost_models import presets

ROOT = Path(__file__).resolve().parents[1]
H100 = presets.h100().device


def _gpt(**overrides: object):  # type: ignore[no-untyped-def]
    sets = [f"{k}={v}" for k, v in overrides.items()]
    return load_example(ROOT / "examples" / "gpt.py", "tiny", sets, abstract=True)


def test_gpt_model_flops_are_megatrons_formula() -> None:
    """Narayanan et al. SC'21 (eq. 3, without recompute): 72·B·s·L·h²·(1 + s/(6h) + V/(12·h·L))."""
    ex = _gpt()
    c = ex.config
    B, s, L, h, V = c.batch, c.seq_len, c.layers, c.hidden, c.vocab
    expected = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * h * L))
    got = model_flops(trace(ex.train_step, *ex.args), H100)
    assert got.flops == pytest.approx(expected, rel=1e-12)
    assert got.peak == pytest.approx(H100.peak_flops("float32"))  # fp32 dots run as TF32 on the H100
    assert got.peak == pytest.approx(494.7e12)


def test_a_scanned_layer_stack_counts_every_iteration_and_bf16_uses_its_peak() -> None:
    unrolled = _gpt(layers=3)
    scanned = _gpt(layers=3, scan_layers=True)
    a = model_flops(trace(unrolled.train_step, *unrolled.args), H100)
    b = model_flops(trace(scanned.train_step, *scanned.args), H100)
    assert b.flops == pytest.approx(a.flops, rel=1e-12)
    bf16 = _gpt(dtype="bfloat16")
    f = model_flops(trace(bf16.train_step, *bf16.args), H100)
    assert f.peak == pytest.approx(989.4e12)


def test_plans_report_mfu_bounded_by_the_matmul_efficiency_and_save_it(tmp_path: Path) -> None:
    ex = _gpt(batch=64)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(8,), hardware="h100", time_budget_s=5)
    assert isinstance(plan, Plan) and plan.model_flops is not None
    devices = 8
    expected = plan.model_flops.flops / (plan.predicted_step_time * devices * plan.model_flops.peak)
    assert plan.mfu == pytest.approx(expected)
    # the cost model runs matmuls at matmul_efficiency of the peak at best, and everything else costs time
    assert 0 < plan.mfu < H100.matmul_efficiency
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again.model_flops == plan.model_flops and math.isclose(again.mfu or 0, plan.mfu)
    assert f"predicted MFU {100 * plan.mfu:.1f}%" in format_plan(plan)


def test_a_pipelined_plan_counts_the_whole_steps_flops(tmp_path: Path) -> None:
    from autoshard.pipeline import PipelinePlan, format_pipeline_plan

    ex = _gpt(batch=16)
    whole = model_flops(trace(ex.train_step, *ex.args), H100)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(8,), hardware="h100", microbatches=4, pipeline=True,
                          time_budget_s=10)
    assert isinstance(plan, PipelinePlan)
    assert plan.model_flops == whole  # all microbatches' work, not one microbatch's
    assert plan.mfu == pytest.approx(whole.flops / (plan.predicted_step_time * 8 * whole.peak))
    assert "predicted MFU" in format_pipeline_plan(plan)
    plan.save(tmp_path / "p.json")
    assert PipelinePlan.load(tmp_path / "p.json").model_flops == whole
