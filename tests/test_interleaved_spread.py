"""The SPMD program's interleaved pipeline as the planner prices it: the uniform cut into chunks, the tail
spread over the last stages where that pays, and the interleaved pipeline derived from a plan the planner
chose (``choose.try_interleaving``) planned from that plan's recompute."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.choose import try_interleaving
from autoshard.pipeline.microbatches import derived_recompute, interleaved_lockstep
from autoshard.pipeline.partition import trace_microbatch
from autoshard.target import PipelineOptions
from autoshard.trace import trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from test_spmd_program import _matches_jit  # noqa: E402

HEAVY = ["layers=4", "batch=32", "vocab=32768"]  # 4 blocks, 4 microbatches of 8 rows, a heavy LM head and loss


def _block_starts(ex: object) -> list[int]:
    """The first op of each numbered block in the step traced at microbatch size, in forward order."""
    micro = trace_microbatch(ex.train_step, ex.args, trace(ex.train_step, *ex.args), 4)
    seen: dict[str, int] = {}
    for op in micro.ops:
        if op.layer and op.layer not in seen:
            seen[op.layer] = op.id
    return list(seen.values())


def test_golden_an_interleaved_pipeline_spreads_a_heavy_tail_over_the_program_s_chunks() -> None:
    # a vocabulary of 32768 beside a hidden size of 64: the LM head and loss cost several blocks. On 2
    # stages of 2 chunks the planner cuts the SPMD program's chunks (a block each, the tail with the last,
    # however heavy) and spreads the tail over both stages, a slice of each microbatch's 8 rows each
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", HEAVY, abstract=True)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), microbatches=4, pipeline=True, stage_shape=(1, 4),
                          schedule="interleaved-1f1b", time_budget_s=8, runtime="spmd", hardware="a100")
    assert plan.spmd and plan.schedule == "interleaved-1f1b" and plan.num_chunks == 2
    assert plan.tail_split == 2 and 0 < plan.tail_time < plan.stages[-1].micro_time
    firsts = [st.layers[0] for st in plan.stages]
    assert firsts == [0, *(plan.layer_of_op[i] for i in _block_starts(ex)[1:])]  # a block each
    assert plan.stages[-1].layers[1] == plan.num_layers - 1


@pytest.mark.slow
def test_an_interleaved_pipeline_with_a_spread_tail_runs_as_planned_and_is_jits() -> None:
    # the plan above, run: the SPMD program spreads the tail as the plan says, its price is the plan's, and
    # the numbers are jax.jit's
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", HEAVY, abstract=False)
    state, batch = ex.args
    step = autoshard.parallelize(ex.train_step, mesh=(2, 4), microbatches=4, pipeline=True, stage_shape=(1, 4),
                                 schedule="interleaved-1f1b", time_budget_s=8, runtime="spmd", hardware="a100")
    _matches_jit(step, ex.train_step, state, batch, steps=2)
    plan, prog = step.plan, step._last.step
    assert plan.num_chunks == 2 and plan.tail_split == 2
    assert prog.num_chunks == 2 and prog.spread is not None and prog.spread.split == plan.tail_split
    assert plan.predicted_step_time == pytest.approx(prog.predicted.step - prog.predicted.dispatch, rel=1e-3)


def test_an_interleaved_pipeline_whose_tail_is_light_keeps_it_on_the_last_stage() -> None:
    # the same step with a vocabulary of 256: the tail is a fraction of a block, and the tick it needs
    # between the last forward and backward costs more than spreading it saves
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", "batch=32"], abstract=True)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), microbatches=4, pipeline=True, stage_shape=(1, 4),
                          schedule="interleaved-1f1b", time_budget_s=8, runtime="spmd", hardware="a100")
    assert plan.num_chunks == 2 and (plan.tail_split, plan.tail_time) == (1, 0.0)


def test_the_derived_interleaved_pipeline_starts_at_the_recompute_of_the_plan_it_comes_from() -> None:
    # a uniform plan of 4 stages of 1x2 with selective recompute; the interleaved pipeline derived from
    # it (2 stages of 1x4 over 2 microbatches) is planned with selective recompute, not with the
    # mode a rule on its microbatch count would guess
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", "batch=32"], abstract=True)
    base = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), microbatches=4, pipeline=True, stage_shape=(1, 2),
                          recompute="selective", time_budget_s=8, runtime="spmd", hardware="a100")
    assert base.spmd and set(base.recompute.values()) == {"selective"}
    asked = []

    def plan_one(count: int, seconds: float | None, shape: tuple[int, int] | None = None,
                 mode: str | None = None, derived: str = "interleaved-1f1b") -> object:
        asked.append((count, shape, mode))  # interleaved 1F1B or ZB-V, whichever ticks price faster
        return dataclasses.replace(base, predicted_step_time=0.5 * base.predicted_step_time)

    got = try_interleaving(base, plan_one, 32, PipelineOptions(uniform=True), left=60.0, took=1.0)
    assert asked == [(2, (1, 4), "selective")]
    assert got.predicted_step_time == 0.5 * base.predicted_step_time


@pytest.mark.parametrize("modes,start", [({}, "none"), ({"b0": "selective", "b1": "selective"}, "selective"),
                                         ({"b0": "full", "b1": "selective"}, "selective"),
                                         ({"b0": "full", "b1": "none"}, "none")])
def test_a_derived_pipeline_starts_at_the_least_recompute_its_base_uses(modes: dict[str, str], start: str) -> None:
    assert derived_recompute(modes) == start


def test_a_derived_interleaved_pipeline_whose_lockstep_ticks_cannot_pay_is_not_planned() -> None:
    # 32 microbatches on 4 stages (fused 1F1B ticks): the base idles little, and the interleaved pipeline's
    # lockstep unit ticks (a forward waiting for a backward on the stage beside it) cost more than its
    # smaller bubble saves, as priced from the base's own stage times: it is neither traced nor planned
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", "batch=64"], abstract=True)
    base = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), microbatches=32, pipeline=True, stage_shape=(1, 2),
                          time_budget_s=20, runtime="spmd", hardware="a100")  # ~8 s here; the stage times
    assert base.spmd and base.num_physical_stages == 4  # must be solved, not cut short on a loaded machine
    ours, derived = interleaved_lockstep(base, 16, 64)
    assert derived >= ours
    # ZB-V's two chunks a stage, priced too, are planned only where their ticks pay (each F, B, W about a
    # forward: no waiting for a backward)
    _, v_shaped = interleaved_lockstep(base, 16, 64, schedule="zb-v")
    asked = []

    def plan_one(count: int, seconds: float | None, shape: tuple[int, int], mode: str | None, name: str) -> object:
        assert name == "zb-v", f"the derived {name} pipeline was planned"
        asked.append((count, shape))
        return dataclasses.replace(base, predicted_step_time=2 * base.predicted_step_time)  # and lost

    assert try_interleaving(base, plan_one, 64, PipelineOptions(uniform=True), left=60.0, took=1.0) is base
    assert asked == ([(16, (1, 4))] if v_shaped < ours else [])
