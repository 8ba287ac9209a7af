"""The single-process MPMD runtime's host work, priced (``pipeline.host``): its counts against what the
runtime does, the plan's step time with it, and the SPMD program chosen where that host work weighs."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.pipeline import PipelinePlan
from autoshard.pipeline.host import DISPATCH_S, PUT_S, HostCosts, host_work
from autoshard.pipeline.partition import split_step
from autoshard.pipeline.report import explain_pipeline
from autoshard.pipeline.runtime import PipelinedStep
from cost_models import load_profile

ROOT = Path(__file__).resolve().parents[1]


def _gpt(batch: int, abstract: bool):
    return load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", f"batch={batch}"], abstract=abstract)


@pytest.mark.parametrize("name", ["1f1b", pytest.param("zb-h1", marks=pytest.mark.slow)])
def test_the_counts_are_what_the_runtime_does(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    M = 4
    ex = _gpt(2 * M, abstract=False)
    step = autoshard.parallelize(ex.train_step, mesh=(2, 4), microbatches=M, pipeline=True, schedule=name,
                                 stage_shape=(1, 2), time_budget_s=5, runtime="mpmd")
    state, batch = ex.args
    state, _ = step(jax.tree.map(lambda a: np.array(a).copy(), state), batch)  # compiles; then one counted step
    runtime = step._last.step
    assert isinstance(runtime, PipelinedStep)
    seen = {"put": 0, "program": 0}
    put = jax.device_put

    def counted_put(*a, **k):
        seen["put"] += 1
        return put(*a, **k)

    monkeypatch.setattr(jax, "device_put", counted_put)
    for prog in runtime.programs.values():
        def call(*a, _f=prog.jitted):
            seen["program"] += 1
            return _f(*a)
        object.__setattr__(prog, "jitted", call)
    step(state, batch)
    plan, graph = step.plan, step.graph
    work = host_work(graph, split_step(graph), plan.stage_of_op(), plan.num_physical_stages, M,
                     weight_pass=name == "zb-h1", costs=HostCosts())
    assert seen["program"] == work.programs
    # every value moved between stages and every parameter placed once a step where the update left it in
    # another layout, counted statically; the runtime skips what is already laid out and puts a value
    # resharded within its stage, which the count does not see
    assert abs(seen["put"] - work.puts) <= max(2, 0.02 * work.puts), (seen, work)
    assert work.calls > work.programs  # and the eager adds of the accumulated results, the batch slices


def test_the_mpmd_plan_prices_its_host_work_and_says_so() -> None:
    ex = _gpt(16, abstract=True)
    # on an H100 the tiny model's stages take microseconds: the host issuing them bounds the step
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), hardware="h100", microbatches=8, pipeline=True,
                          stage_shape=(1, 2), time_budget_s=5, runtime="mpmd")
    assert isinstance(plan, PipelinePlan) and not plan.spmd
    stages = sum(st.micro_time for st in plan.stages)
    assert plan.host_time > 8 * stages
    update = max(st.update_time for st in plan.stages)
    assert plan.predicted_step_time == pytest.approx(plan.host_time + update)
    text = explain_pipeline(plan)
    assert "of host work a step issuing them" in text and "host issuing the programs" in text
    assert PipelinePlan.from_dict(plan.to_dict()).host_time == plan.host_time


def test_one_process_runs_the_spmd_program_where_the_host_work_weighs(caplog: pytest.LogCaptureFixture) -> None:
    ex = _gpt(16, abstract=True)
    with caplog.at_level(logging.INFO, logger="autoshard"):
        # (no time budget: with one, the SPMD plan is made only on what the MPMD plan left of its share)
        plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), hardware="h100", microbatches=8,
                              pipeline=True, stage_shape=(1, 2))
    assert isinstance(plan, PipelinePlan) and plan.spmd and plan.host_time == 0.0
    assert "the SPMD program" in caplog.text and "the MPMD runtime" in caplog.text
    mpmd = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), hardware="h100", microbatches=8, pipeline=True,
                          stage_shape=(1, 2), time_budget_s=5, runtime="mpmd")
    assert plan.predicted_step_time < mpmd.predicted_step_time


def test_host_costs_come_from_the_profile_or_defaults() -> None:
    assert HostCosts.of(load_profile("h100")) == HostCosts(call=DISPATCH_S, put=PUT_S)
    cpu = load_profile("cpu-8dev-2026-11-21.json")
    costs = HostCosts.of(cpu)
    assert costs.call == cpu.host["call"] and costs.put == cpu.host["put"] and costs.arg == cpu.host["arg"]
