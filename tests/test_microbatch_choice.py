"""The microbatch count as a planner decision (``autoshard.pipeline.microbatches``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training.train_state import TrainState

import autoshard
from autoshard._examples import load_module
from autoshard.choose import activations_bound
from autoshard.pipeline import PipelinePlan
from autoshard.pipeline.microbatches import candidates, first_recompute, interleaving, search
from autoshard.pipeline.partition import PipelineError
from autoshard.planner.plan import DoesNotFit, Plan
from autoshard.target import cost_model_for
from autoshard.trace.recompute import estimate
from cost_models import CostModel


def test_the_pipeline_starts_recomputing_where_a_stage_share_of_the_activations_fills_a_device() -> None:
    """GPT-39B on 8x8 (429 GB per device as traced, 72 GB budget, 128 microbatches): a stage of 8 keeps
    8/128 of it, 26.8 GB, under half the budget: planned as traced. GPT-1T on 384x8 (564 GB as traced,
    88.7 GB with selective recompute, 1024 microbatches): 384/1024 of them, 211 GB as traced and 33.3 GB
    selective: selective first. Needs are asked for lazily, and no budget means no recompute first."""
    asked: list[str] = []

    def need(table: dict[str, float]):
        def get(mode: str) -> float:
            asked.append(mode)
            return table[mode]
        return get

    assert first_recompute(need({"none": 429e9}), 8, 128, 72e9) == "none" and asked == ["none"]
    assert first_recompute(need({"none": 564e9, "selective": 88.7e9}), 384, 1024, 72e9) == "selective"
    assert first_recompute(need({"none": 564e9, "selective": 300e9}), 384, 1024, 72e9) == "full"
    asked.clear()
    assert first_recompute(need({}), 384, 1024, None) == "none" and not asked


def test_candidates_are_powers_of_two_dividing_the_batch_from_the_bubble_bound() -> None:
    # 8 hosts: 7 stages' bubble 7 / (B + 7) <= 10% needs B >= 63
    assert candidates(1024, 8) == [64, 128, 256]
    for b in candidates(1024, 8, limit=10):
        assert 1024 % b == 0 and b & (b - 1) == 0
        assert 7 / (b + 7) <= 0.1
    # one host: two stages, B >= 9
    assert candidates(96, 1) == [16, 32]
    # a batch too small for the bound: its largest power-of-two divisor
    assert candidates(24, 8) == [8]
    assert candidates(1, 8) == []
    assert candidates(7, 2) == []
    # a step that needs 429 GB per device unpipelined, on a 72 GB budget: a stage of 8 keeps about 8/B of
    # it, which should fill at most half the budget, so B >= 95.2 (GPT-39B bf16 at batch 1024 on 8x8 H100s)
    assert candidates(1024, 8, activations=429e9, budget=72e9) == [128, 256, 512]
    assert candidates(1024, 8, activations=844e9, budget=72e9) == [256, 512, 1024]  # the same in fp32
    assert candidates(1024, 8, activations=10e9, budget=72e9) == [64, 128, 256]  # the bubble binds


@dataclasses.dataclass
class _Plan:
    num_microbatches: int
    predicted_step_time: float


def test_search_keeps_the_fastest_and_stops_once_a_larger_count_is_slower() -> None:
    times = {64: 30.0, 128: 20.0, 256: 25.0, 512: 10.0}
    asked = []

    def plan_one(count: int, seconds: float | None) -> _Plan:
        asked.append(count)
        return _Plan(count, times[count])

    best, tried = search([64, 128, 256, 512], plan_one, None, lambda: 0.0)
    assert best.num_microbatches == 128
    assert asked == [64, 128, 256]  # 512 not planned: 256 was already slower than 128
    assert [c for c, _ in tried] == asked


def test_search_skips_counts_that_do_not_plan_and_splits_the_time_budget() -> None:
    shares, now = [], [0.0]

    def plan_one(count: int, seconds: float | None) -> _Plan:
        shares.append(seconds)
        now[0] += seconds  # each plan spends its whole share
        if count == 8:
            raise PipelineError("does not fit")
        return _Plan(count, 100.0 / count)

    best, tried = search([8, 16, 32], plan_one, 30.0, lambda: now[0])
    assert best.num_microbatches == 32
    assert isinstance(tried[0][1], PipelineError)
    assert shares == pytest.approx([10.0, 10.0, 10.0])


def test_search_passes_unspent_time_on() -> None:
    shares = []

    def plan_one(count: int, seconds: float | None) -> _Plan:
        shares.append(seconds)
        return _Plan(count, 100.0 / count)

    search([8, 16, 32], plan_one, 30.0, lambda: 0.0)  # no time spent: what is left is shared again
    assert shares == pytest.approx([10.0, 15.0, 30.0])


def test_search_stops_before_a_count_it_cannot_afford() -> None:
    """A count that overran its share (a pipeline plan's floors) leaves less than half of what it took:
    the next count, which would take as long whatever its share, is not started."""
    now = [0.0]

    def plan_one(count: int, seconds: float | None) -> _Plan:
        now[0] += 56.0  # GPT-39B's first count: 56 s of a 30 s share
        return _Plan(count, 100.0 / count)

    best, tried = search([128, 256], plan_one, 60.0, lambda: now[0])
    assert best.num_microbatches == 128 and [c for c, _ in tried] == [128]


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(4):
            x = jnp.tanh(nn.Dense(24, name=f"dense_{i}")(x))
        return jnp.mean(x**2)


def _step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    loss, grads = jax.value_and_grad(lambda p: state.apply_fn({"params": p}, batch["x"]))(state.params)
    with jax.numpy_dtype_promotion("standard"):
        return state.apply_gradients(grads=grads), {"loss": loss}


def _h100_issuing_instantly() -> CostModel:
    """The h100 preset on 8 devices with a host that issues programs in no time: the tests below are about
    the microbatch-count search, and their tiny MLP's stages take microseconds, against milliseconds of
    the MPMD runtime's host work a step (``pipeline.host``), which would otherwise decide alone."""
    cost = CostModel.load("h100", mesh_shape=(8,), axis_names=("x",))
    host = {"call": 1e-12, "arg": 1e-12, "put": 1e-12}
    return dataclasses.replace(cost, profile=dataclasses.replace(cost.profile, host=host))


def test_a_step_cramped_unpipelined_is_pipelined_with_a_count_the_planner_picks() -> None:
    """2048 rows of a 4-layer MLP on 8 devices: with room, the intra-operator plan is kept and no pipeline
    planned; under a budget that only ZeRO-style layouts meet unpipelined (peak within 10% of it), the
    planner also plans pipelines of the candidate counts and returns the faster plan, which fits."""
    model, cost = _MLP(), _h100_issuing_instantly()
    x = jax.ShapeDtypeStruct((2048, 16), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    state = jax.eval_shape(lambda p: TrainState.create(apply_fn=model.apply, params=p, tx=optax.adam(1e-2)), params)
    roomy = autoshard.plan(_step, state, {"x": x}, mesh=(8,), hardware=cost, memory_budget=None, time_budget_s=10)
    assert isinstance(roomy, Plan) and roomy.solver.pipeline_step_time is None
    budget = 0.15 * roomy.peak_memory
    tight = autoshard.plan(_step, state, {"x": x}, mesh=(8,), hardware=cost, memory_budget=budget, time_budget_s=10)
    assert isinstance(tight, PipelinePlan)
    assert tight.num_microbatches in candidates(2048, 1)
    assert max(st.memory for st in tight.stages) <= budget
    assert isinstance(tight.solver.intra_op_step_time, float)  # the intra-operator plan it beat
    assert tight.predicted_step_time < tight.solver.intra_op_step_time
    given = autoshard.plan(_step, state, {"x": x}, mesh=(8,), hardware=cost, memory_budget=budget, microbatches=8, pipeline=True,
                           time_budget_s=10)
    assert given.num_microbatches == 8


def test_a_pipeline_search_not_asked_for_stays_within_the_time_budget(monkeypatch, caplog) -> None:
    """The cramped step above, with the intra-operator planning made to look as if it used 9.5 s of the 10 s
    budget (a clock that jumps when it returns): no pipeline is searched for, the intra-operator plan comes
    back and the log says why. Asked for (``microbatches=8``), the pipeline is still planned."""
    import time as time_module

    import autoshard.choose as choose

    model, cost = _MLP(), _h100_issuing_instantly()
    x = jax.ShapeDtypeStruct((2048, 16), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    state = jax.eval_shape(lambda p: TrainState.create(apply_fn=model.apply, params=p, tx=optax.adam(1e-2)), params)
    roomy = autoshard.plan(_step, state, {"x": x}, mesh=(8,), hardware=cost, memory_budget=None, time_budget_s=10)
    budget = 0.15 * roomy.peak_memory
    real_clock, real_plan = time_module.perf_counter, choose.plan_recomputing
    skipped = [0.0]

    def plan_recomputing(*a, **kw):
        out = real_plan(*a, **kw)
        skipped[0] = 9.5
        return out

    monkeypatch.setattr(time_module, "perf_counter", lambda: real_clock() + skipped[0])
    monkeypatch.setattr(choose, "plan_recomputing", plan_recomputing)
    with caplog.at_level("INFO", logger="autoshard"):
        tight = autoshard.plan(_step, state, {"x": x}, mesh=(8,), hardware=cost, memory_budget=budget, time_budget_s=10)
    assert isinstance(tight, Plan) and tight.solver.pipeline_step_time is None
    assert "too little to search for a pipeline" in caplog.text
    assert "no pipeline was searched for" in (tight.solver.cut_short or "")  # and the plan's summary says so
    skipped[0] = 0.0
    given = autoshard.plan(_step, state, {"x": x}, mesh=(8,), hardware=cost, memory_budget=budget, microbatches=8, time_budget_s=10)
    assert isinstance(given, PipelinePlan)


def test_the_first_count_is_sized_by_the_step_as_traced_also_when_it_fits_by_recomputing() -> None:
    """The activations that size the first candidate count are the step's as traced: the bound the failed
    intra-operator planning proved, or, when that plan fits only by recomputing, the same bound estimated
    (GPT-39B on 8x8: 128 microbatches, where the recompute plan's own peak gave 64 and a 1.5x slower
    pipeline); none when the step fits as traced."""
    mod = load_module(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
    graph = autoshard.trace(mod.train_step, *mod.make("tiny", abstract=True, layers=2, batch=16, seq_len=32))
    cost = cost_model_for("h100", (8,), ("x",))
    bound = estimate(graph, "none").peak_bytes / cost.mesh.num_devices
    asked = []

    def need(mode: str) -> float:
        asked.append(mode)
        return estimate(graph, mode).peak_bytes / cost.mesh.num_devices

    assert activations_bound(need, SimpleNamespace(recompute={"block_0": "full"}), None) == bound and asked == ["none"]
    assert activations_bound(need, SimpleNamespace(recompute={}), None) is None
    assert activations_bound(need, None, DoesNotFit("does not fit", needed=5e9, as_traced=7e9)) == 7e9
    assert asked == ["none"]  # the bound the failed planning proved is not estimated again


def test_the_interleaved_pipeline_priced_beside_uniform_stages_doubles_them_and_halves_the_count() -> None:
    """Megatron's GPT-1T layout from the plan the DP makes at 1024 microbatches (128 stages of 3x8, a block
    each): 64 stages of 6x8 over 512 microbatches of 6 rows, two chunks a stage. Inside a host a stage
    doubles its devices; nothing is proposed where the stages differ, the counts do not divide, or the
    layers are too few for two chunks per stage."""
    assert interleaving([(3, 8)] * 128, 1024, 3072, (384, 8), 129) == (512, (6, 8))
    assert interleaving([(1, 2)] * 4, 8, 64, (1, 8), 8) == (4, (1, 4))
    assert interleaving([(1, 8)] * 8, 128, 1024, (8, 8), 49) == (64, (2, 8))
    assert interleaving([(1, 4), (1, 8)], 8, 64, (1, 16), 8) is None  # stages of two shapes
    assert interleaving([(1, 4)] * 2, 8, 64, (1, 8), 8) is None  # one stage of 1x8 left: nothing to interleave
    assert interleaving([(3, 8)] * 128, 1024, 3072, (384, 8), 127) is None  # 64 stages x 2 chunks > 127 layers
    assert interleaving([(1, 2)] * 4, 6, 12, (1, 8), 8) is None  # 3 microbatches over 2 stages
    assert interleaving([(2, 8)] * 4, 8, 8, (8, 8), 16) is None  # 2 rows a microbatch over 4 hosts


def test_an_interleaved_pipeline_is_kept_only_when_faster_and_tried_only_when_the_planner_chooses() -> None:
    """``choose.try_interleaving``: the interleaved plan replaces the chosen one when it prices faster; it is not
    planned when the user fixed the schedule or the stages, when no budget was given and the chosen plan
    idles little, or when the user's budget has too little left; a failure keeps the chosen plan."""
    from autoshard.choose import try_interleaving
    from autoshard.target import PipelineOptions

    def pipe(t: float, bubble: float = 0.2):
        return SimpleNamespace(stages=[SimpleNamespace(submesh=(1, 2))] * 4, num_microbatches=8, cluster=(1, 8),
                               num_layers=8, predicted_step_time=t, bubble_fraction=bubble, schedule="1f1b",
                               recompute={}, spmd=False)

    asked = []

    def plan_one(count, seconds, shape, mode, derived="interleaved-1f1b"):
        asked.append((count, shape, mode, derived))
        return pipe(0.9)

    auto = PipelineOptions()
    faster = try_interleaving(pipe(1.0), plan_one, 64, auto, None, 5.0)
    assert faster.predicted_step_time == 0.9 and asked == [(4, (1, 4), "none", "interleaved-1f1b")]
    slower = pipe(0.5)
    assert try_interleaving(slower, plan_one, 64, auto, None, 5.0) is slower
    for options, left, bubble in ((PipelineOptions(schedule="1f1b"), None, 0.2),
                                  (PipelineOptions(stage_shape=(1, 2)), None, 0.2),
                                  (auto, None, 0.05), (auto, 1.0, 0.2)):
        chosen = pipe(1.0, bubble)
        assert try_interleaving(chosen, plan_one, 64, options, left, 5.0) is chosen
    assert len(asked) == 2
    # an SPMD plan's derived stages are priced as interleaved 1F1B and as ZB-V from its own stage times
    # (ZB-H1 on 4 stages over 8 microbatches, unit stages: 10 of ticks; interleaved 1F1B on 2 stages of 2
    # chunks over 4: 10.67, a forward waiting for a backward each tick; ZB-V: 8.67), the faster planned
    spmd = SimpleNamespace(**vars(pipe(1.0)), tail_split=1, fused_ticks=False, tail_time=0.0, peak_memory=4e9,
                           memory_budget=8e9)
    spmd.spmd, spmd.schedule, spmd.stages = True, "zb-h1", [SimpleNamespace(submesh=(1, 2), micro_time=1.0)] * 4
    assert try_interleaving(spmd, plan_one, 64, auto, None, 5.0).predicted_step_time == 0.9
    assert asked[-1] == (4, (1, 4), "none", "zb-v")
    # a V's stage holds two of the base's chunks: not planned where twice the base's fullest stage overflows
    # (interleaved 1F1B's ticks, 10.67 to the base's 10, are not planned either)
    spmd.peak_memory = 4.1e9
    assert try_interleaving(spmd, plan_one, 64, auto, None, 5.0) is spmd and len(asked) == 3

    def fails(count, seconds, shape, mode, derived="interleaved-1f1b"):
        raise PipelineError("no cut fits")

    chosen = pipe(1.0)
    assert try_interleaving(chosen, fails, 64, auto, 10.0, 5.0) is chosen


def test_a_traced_graph_asked_for_microbatches_is_refused_with_what_to_pass_instead() -> None:
    """A pipeline traces the step again at microbatch size, which a ``Graph`` cannot be: the error says to pass
    the step function and its arguments (``choose``), after the intra-operator plan, which a graph can have."""
    from autoshard.target import PlanningError

    model = _MLP()
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    state = jax.eval_shape(lambda p: TrainState.create(apply_fn=model.apply, params=p, tx=optax.adam(1e-2)), params)
    graph = autoshard.trace(_step, state, {"x": x})
    assert isinstance(autoshard.plan(graph, mesh=(2,), time_budget_s=2), Plan)
    with pytest.raises(PlanningError, match="pass the step function and its arguments, not a Graph"):
        autoshard.plan(graph, mesh=(2,), microbatches=4, time_budget_s=2)
