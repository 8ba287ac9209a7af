"""One deadline for a whole planning call (``planner.deadline``, issue 49 item 2): every phase reads the same
clock, and once the budget is spent the planner takes the quickest way to a plan that runs and says what it
cut short. Driven by a fake clock that advances at every reading, never by timing anything: these tests
hold on a loaded machine."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import autoshard
from autoshard.api import plan_for
from autoshard.emit import emit
from autoshard.emit.program import global_rel_error
from autoshard.pipeline import PipelinePlan, build_pipelined_step
from autoshard.pipeline.microbatches import search
from autoshard.planner.deadline import Deadline
from autoshard.planner.plan import DoesNotFit, Plan
from autoshard.planner.planning import plan_graph
from autoshard.target import PipelineOptions, Target
from autoshard.trace import trace
from autoshard.trace.recompute import estimate
from cost_models import CostModel


class _Clock:
    """A clock that moves ``step`` seconds at every reading: any phase that reads it spends time."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.readings = 0.0, step, 0

    def __call__(self) -> float:
        self.now += self.step
        self.readings += 1
        return self.now


from test_microbatch_choice import _MLP, _step  # noqa: E402  (the same 4-layer MLP step)


def _state(rows: int, concrete: bool = False) -> tuple[TrainState, dict[str, jax.Array]]:
    model = _MLP()
    x = jnp.ones((rows, 16), jnp.float32) if concrete else jax.ShapeDtypeStruct((rows, 16), jnp.float32)

    def make(x: jax.Array) -> TrainState:
        params = model.init(jax.random.key(0), x)["params"]
        return TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))

    state = make(x) if concrete else jax.eval_shape(make, x)
    if concrete:
        x = jax.random.normal(jax.random.key(1), (rows, 16), jnp.float32)
    return state, {"x": x}


def _cost() -> CostModel:
    """h100 on 8 devices, its host issuing programs in no time (the MLP's stages take microseconds)."""
    cost = CostModel.load("h100", mesh_shape=(8,), axis_names=("x",))
    host = {"call": 1e-12, "arg": 1e-12, "put": 1e-12}
    return dataclasses.replace(cost, profile=dataclasses.replace(cost.profile, host=host))


def test_the_deadline_reads_its_clock_and_records_what_was_cut() -> None:
    clock = _Clock(1.0)
    d = Deadline(3.0, clock=clock)  # started at 1
    assert d.left() == pytest.approx(2.0)  # read at 2
    assert not d.spent()  # read at 3: 1 s left
    assert d.spent()  # read at 4: the end
    assert d.note() is None
    d.cut("the layers")
    d.cut("the layers")  # once
    assert d.cuts == ["the layers"] and "3 s time budget ran out" in (d.note() or "")
    unbounded = Deadline(None, clock=clock)
    assert unbounded.left() is None and not unbounded.spent()


def test_a_search_stops_at_the_deadline_and_always_plans_its_first_count() -> None:
    """Each count takes 5 s of a 10 s budget: the search stops at the deadline (and before it, once what is
    left is under half of what a count took), however many counts remain; with nothing left at all, the first count is still planned (a search that
    ends empty-handed returns no plan)."""
    clock = _Clock(0.0)
    tried_counts = []

    @dataclasses.dataclass
    class _Planned:
        num_microbatches: int
        predicted_step_time: float

    def plan_one(count: int, seconds: float | None) -> _Planned:
        tried_counts.append(count)
        clock.now += 5.0
        return _Planned(count, 100.0 / count)  # each count faster than the last: only time stops it

    deadline = Deadline(10.0, clock=clock)
    best, tried = search([8, 16, 32, 64, 128], plan_one, deadline.left(), deadline.clock)
    assert tried_counts == [c for c, _ in tried] == [8, 16] and best.num_microbatches == 16
    assert deadline.spent()
    tried_counts.clear()
    best, _ = search([8, 16], plan_one, 0.0, clock)
    assert tried_counts == [8] and best.num_microbatches == 8


def test_a_spent_budget_still_returns_a_plan_that_runs_and_says_so() -> None:
    """A step that fits as traced, planned with a budget spent before planning began (a clock that jumps
    100 s at every reading): the intra-operator plan comes back, verified against the step, emitted and
    run on the 8 devices with jax.jit's loss, and its summary says the budget ran out and what to raise."""
    state, batch = _state(64, concrete=True)
    target = Target.of((8,), _cost(), None)
    deadline = Deadline(1.0, clock=_Clock(100.0))
    the_plan, graph, _ = plan_for(_step, (state, batch), target, PipelineOptions(), time_budget_s=1.0,
                                  deadline=deadline)
    assert isinstance(the_plan, Plan)
    the_plan.verify(graph)
    note = the_plan.solver.cut_short
    assert note is not None and "time budget ran out" in note and "--time-budget" in note
    assert "intra-operator plan was solved in the solver's least time" in note
    assert "time budget:" in autoshard.explain(the_plan) or "time budget:" in _summary(the_plan)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    step = emit(graph, the_plan.specs, mesh)
    placed = step.place(state, batch)  # copies of the one-device arrays, in the plan's layouts
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(placed), step.in_shardings, strict=True))
    _, metrics = step(*placed)
    assert not any(x.is_deleted() for x in jax.tree.leaves((state, batch)) if isinstance(x, jax.Array))
    _, expected = jax.jit(_step)(state, batch)
    assert float(metrics["loss"]) == pytest.approx(float(expected["loss"]), rel=1e-5)


def _summary(the_plan: Plan | PipelinePlan) -> str:
    from autoshard.pipeline import format_pipeline_plan
    from autoshard.planner.summary import format_plan

    return format_plan(the_plan) if isinstance(the_plan, Plan) else format_pipeline_plan(the_plan)


@pytest.mark.parametrize("core_free", [False, True], ids=["busy", "core-free"])
def test_a_step_that_cannot_fit_as_traced_is_pipelined_first_when_the_budget_is_spent(
        core_free: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MLP at 2048 rows under half the memory it needs as traced (every value split its furthest), with
    the budget spent by tracing: the planner plans the pipeline (which must be planned anyway) before the
    intra-operator plan, and once it has one it skips the rest: no intra-operator plan, no further
    microbatch counts, the layers priced on each submesh shape as it is only, the layers other than the
    block on one shape only, the stages their layers' plans joined with no solve. The plan fits, checks
    against its microbatch trace, runs one step with jax.jit's loss and parameters, and its summary lists
    each cut. With a core free (a step large enough to plan its intra-operator plan in a forked child)
    alike: a child would be waited for (GPT-1.3B on 2x4, budget 5 s: its intra-operator problem took 13 s
    to build beside the pipeline's search)."""
    if core_free:
        monkeypatch.setattr("autoshard.choose.BESIDE_MIN_OPS", 0)
        monkeypatch.setattr("autoshard.choose.can_fork", lambda: True)
    state, batch = _state(2048, concrete=True)
    cost = _cost()
    graph = trace(_step, state, batch)
    budget = 0.5 * estimate(graph, "none").peak_bytes / cost.mesh.num_devices
    target = Target.of((8,), cost, budget)
    deadline = Deadline(10.0, clock=_Clock(100.0))
    the_plan, _, micro = plan_for(_step, (state, batch), target, PipelineOptions(), time_budget_s=10.0,
                                  deadline=deadline)
    assert isinstance(the_plan, PipelinePlan)
    assert micro is not None
    the_plan.verify(micro)
    assert the_plan.peak_memory <= budget
    assert the_plan.solver.intra_op_step_time is None  # the intra-operator plan was never made
    note = the_plan.solver.cut_short or ""
    assert "intra-operator plan (recomputing) was not made" in note
    assert "2-D layouts" in note
    assert re.search(r"layers were priced on 1 of \d+ submesh shapes", note)
    assert "stages are their layers' plans joined, not solved whole" in note
    assert "time budget:" in _summary(the_plan)
    step = build_pipelined_step(micro, the_plan, jax.devices())
    s_pip, m_pip = step(state, batch)
    s_ref, m_ref = jax.jit(_step)(state, batch)
    assert global_rel_error(m_ref, m_pip) <= 1e-5
    assert global_rel_error(s_ref.params, s_pip.params) <= 1e-5


def test_a_plan_not_solved_is_its_best_start_as_it_is() -> None:
    """``plan_graph(solve=False)`` (a pipeline stage once the call's budget is spent): given a plan of the graph
    as a start, it returns that plan's layouts and price with no solve, and says so; with no start that fits
    (none given, or one over the memory budget), it plans as usual."""
    state, batch = _state(64)
    graph = trace(_step, state, batch)
    cost = _cost()
    solved = plan_graph(graph, cost, time_budget_s=2.0)
    assert "not solved" not in solved.solver.status
    taken = plan_graph(graph, cost, time_budget_s=2.0, starts=[solved], solve=False)
    assert "not solved" in taken.solver.status and taken.solver.solve_seconds == 0.0
    assert taken.solver.choice == solved.solver.choice
    assert taken.predicted_step_time == pytest.approx(solved.predicted_step_time)
    assert "not solved" not in plan_graph(graph, cost, time_budget_s=2.0, solve=False).solver.status
    tight = 0.9 * solved.peak_memory
    try:
        over = plan_graph(graph, cost, time_budget_s=2.0, starts=[solved], solve=False, memory_budget=tight)
    except DoesNotFit:
        return
    assert "not solved" not in over.solver.status and over.peak_memory <= tight
