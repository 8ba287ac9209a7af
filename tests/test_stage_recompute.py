"""Recompute chosen per pipeline stage (``pipeline.stages``' stage DP with a recompute mode per stage): under
1F1B the first stage holds the most microbatches in flight and the last one holds one, so the stages that
must recompute to fit are the first ones; the others keep their blocks as traced and run faster."""

from __future__ import annotations

import dataclasses
import functools
import itertools
from pathlib import Path
from typing import Any

import jax
import pytest

import autoshard
from autoshard._examples import load_module
from autoshard.emit import global_rel_error
from autoshard.pipeline import PipelinePlan, format_pipeline_plan
from autoshard.trace.remat import REMAT_MODES

GPT = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
# activations large beside the weights: a stage's memory is mostly its microbatches in flight
CONFIG = {"layers": 4, "batch": 64, "seq_len": 256}
# 4 stages of one device over 8 microbatches (1F1B keeps 4, 3, 2, 1 in flight); 70 MB per device: as
# traced, the first stages do not fit (the step is planned with selective recompute first) and the last ones do
PIPE: dict[str, Any] = dict(mesh=(1, 4), pipeline=True, microbatches=8, stage_shape=(1, 1), memory_budget=70e6,
                            time_budget_s=20)
TOL = 1e-5


@functools.cache
def _step() -> tuple[Any, tuple[Any, ...]]:
    mod = load_module(GPT)
    return mod.train_step, jax.jit(lambda: mod.make("tiny", **CONFIG))()


@dataclasses.dataclass(frozen=True)
class _Planned:
    """What ``plan_pipeline_recomputing`` reads of a plan."""

    recompute: dict[str, str]


def _modes_in_block_order(plan: PipelinePlan) -> list[str]:
    return [plan.recompute[b] for b in sorted(plan.recompute, key=lambda b: int(b.rsplit("_", 1)[1]))]


def test_the_stages_holding_fewer_microbatches_recompute_less_and_the_step_matches_jit() -> None:
    step, args = _step()
    ref = jax.jit(step)
    par = autoshard.parallelize(step, **PIPE)
    s_ref = s_par = args[0]
    for _ in range(2):
        s_ref, m_ref = ref(s_ref, args[1])
        s_par, m_par = par(s_par, args[1])
        assert global_rel_error(m_ref, m_par) <= TOL
        assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL
    plan = par.plan
    assert isinstance(plan, PipelinePlan) and len(plan.stages) == 4
    modes = _modes_in_block_order(plan)
    # the first blocks recompute, the last ones do not: never a block recomputing more than one before it
    assert modes[0] != "none" and modes[-1] == "none", modes
    assert all(REMAT_MODES.index(a) >= REMAT_MODES.index(b) for a, b in itertools.pairwise(modes)), modes
    assert plan.stages[-1].recompute == "none" and plan.stages[0].recompute.startswith(modes[0])
    text = format_pipeline_plan(plan)
    assert "chosen per stage" in text and "  recompute" in text
    assert plan.peak_memory <= PIPE["memory_budget"]
    # recompute on every block, as a fixed setting gives it, is slower on the same stages
    same = autoshard.plan(step, *args, hardware="auto", recompute=modes[0], **PIPE)
    assert isinstance(same, PipelinePlan) and set(same.recompute.values()) == {modes[0]}
    assert not any(st.recompute for st in same.stages)
    assert plan.predicted_step_time < same.predicted_step_time


@pytest.mark.slow  # CI: per-stage recompute run against jit (above)
def test_a_plan_with_recompute_per_stage_survives_save_and_load_and_runs(tmp_path: Path) -> None:
    step, args = _step()
    plan = autoshard.plan(step, *args, hardware="auto", **PIPE)
    assert isinstance(plan, PipelinePlan) and len(set(plan.recompute.values())) == 2
    path = tmp_path / "pipe.json"
    plan.save(path)
    back = PipelinePlan.load(path)
    assert dict(back.recompute) == dict(plan.recompute)
    assert [st.recompute for st in back.stages] == [st.recompute for st in plan.stages]
    # the loaded plan rewrites the step block by block as planned (its digest is checked) and runs it
    s, m = autoshard.parallelize(step, mesh=PIPE["mesh"], plan=str(path))(*args)
    s_ref, m_ref = jax.jit(step)(*args)
    assert global_rel_error(m_ref, m) <= TOL and global_rel_error(s_ref.opt_state, s.opt_state) <= TOL


def test_the_spmd_program_recomputes_alike_on_every_stage() -> None:
    """Its lockstep ticks last as long as the slowest stage's work: a cheaper mode on the last stages would
    buy nothing there, and every stage runs one program, so its stages take one mode."""
    step, args = _step()
    plan = autoshard.plan(step, *args, hardware="auto", runtime="spmd", **PIPE)
    assert isinstance(plan, PipelinePlan) and plan.spmd
    assert len(set(plan.recompute.values())) == 1 and not any(st.recompute for st in plan.stages)


def test_modes_the_first_recompute_rule_skips_are_options_unless_no_stage_can_hold_them() -> None:
    from autoshard.pipeline.partition import trace_microbatch
    from autoshard.pipeline.recompute import plan_pipeline_recomputing

    step, args = _step()
    micro = trace_microbatch(step, args, autoshard.trace(step, *args), 8)
    offered: list[list[str] | None] = []

    def plan(graph: Any, seconds: float | None, modes: Any) -> Any:
        offered.append(None if modes is None else [m for m, _ in modes.graphs])
        return _Planned(modes.config(modes.graphs[-1][0]) if modes is not None else {})

    # planned with selective first: the step as traced is the per-stage option (float32: ``invariant``
    # replays nothing, so it is none)
    _, graph = plan_pipeline_recomputing(micro, plan, start="selective")
    assert offered == [["none", "selective"]] and graph is not micro
    offered.clear()
    plan_pipeline_recomputing(micro, plan, start="selective", hopeless=lambda m: m == "none")
    assert offered == [None]
