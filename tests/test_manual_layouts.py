"""Hand-written layouts priced with the planner's cost model: the textbook layouts by name, rules and
logical axes, the best completion by the ILP, and budgets they do not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
from jax.sharding import PartitionSpec

import autoshard
from autoshard._examples import load_example
from autoshard.planner import layouts
from autoshard.planner.compare import diff_plans, price_layout
from autoshard.planner.plan import PlanError
from autoshard.planner.planning import ProblemCache, plan_graph
from cost_models import CostModel, ShardingSpec

ROOT = Path(__file__).resolve().parents[1]


def _mlp(preset: str, names: tuple[str, ...], shape: tuple[int, ...] = (8,)):
    ex = load_example(ROOT / "examples" / "mlp.py", preset, abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    return graph, CostModel.load("h100", mesh_shape=shape, axis_names=names)


@pytest.fixture(scope="module")
def big_batch():
    graph, cost = _mlp("big-batch", ("data",))
    problems = ProblemCache(graph)
    return graph, cost, problems, plan_graph(graph, cost, hardware="h100", time_budget_s=10, problems=problems)


@pytest.fixture(scope="module")
def wide():
    graph, cost = _mlp("wide", ("model",))
    problems = ProblemCache(graph)
    return graph, cost, problems, plan_graph(graph, cost, hardware="h100", time_budget_s=10, problems=problems)


def _specs(layout: layouts.HandLayout) -> dict[str, str]:
    return {k: str(v) for k, v in layout.specs.items()}


def test_data_parallel_on_the_big_batch_costs_what_the_automatic_plan_costs(big_batch) -> None:
    graph, cost, problems, auto = big_batch
    dp = layouts.data_parallel(graph, cost.mesh)
    specs = _specs(dp)
    assert specs["batch.x"] == "S(data)·R" and specs["batch.y"] == "S(data)"
    assert specs["state.params.dense_0.kernel"] == "R·R" and specs["state.opt_state[0].mu.dense_0.kernel"] == "R·R"
    priced = price_layout(graph, cost, dp, hardware="h100", time_budget_s=10, problems=problems)
    assert priced.feasible and priced.plan.solver.fixed_inputs == len(graph.inputs)
    # the automatic plan is data parallel here (tests/test_golden.py), so the two are the same plan
    assert priced.step_time == pytest.approx(auto.predicted_step_time, rel=1e-9)
    assert priced.plan.time_breakdown.keys() == auto.time_breakdown.keys()
    assert {t.name: t.spec for t in priced.plan.inputs} == dp.specs


def test_megatron_on_the_wide_mlp_is_the_column_row_pair_and_matches_auto(wide) -> None:
    graph, cost, problems, auto = wide
    tp = layouts.megatron(graph, cost.mesh)
    specs = _specs(tp)
    assert specs["state.params.dense_0.kernel"] == "R·S(model)"  # column-parallel, bias with it
    assert specs["state.params.dense_0.bias"] == "S(model)"
    assert specs["state.params.dense_1.kernel"] == "S(model)·R"  # row-parallel, bias whole
    assert specs["state.params.dense_1.bias"] == "R"
    assert specs["state.opt_state[0].nu.dense_1.kernel"] == "S(model)·R"  # moments follow their parameter
    assert specs["batch.x"] == "R·R"
    priced = price_layout(graph, cost, tp, time_budget_s=10, problems=problems)
    assert priced.step_time == pytest.approx(auto.predicted_step_time, rel=1e-9)
    assert diff_plans(priced.plan, auto).layouts == ()


def test_zero_stages_shard_optimizer_state_then_parameters(wide) -> None:
    graph, cost, problems, _ = wide
    kernel, mu = "state.params.dense_0.kernel", "state.opt_state[0].mu.dense_0.kernel"
    z1, z2, z3 = (layouts.zero(graph, cost.mesh, s) for s in (1, 2, 3))
    assert _specs(z1)[kernel] == "R·R" and _specs(z1)[mu] == "R·S(model)"  # largest dimension: 16384
    assert z2.specs == z1.specs  # gradients are not inputs: ZeRO-2 pins what ZeRO-1 pins
    assert _specs(z3)[kernel] == "R·S(model)" and _specs(z3)[mu] == "R·S(model)"
    assert _specs(z3)["state.opt_state[0].count"] == "()"
    dp = layouts.data_parallel(graph, cost.mesh)
    mem = {lay.name: price_layout(graph, cost, lay, time_budget_s=5, problems=problems).plan
           for lay in (dp, z1, z3)}
    from autoshard.planner.explain import memory_breakdown

    state = {k: memory_breakdown(p)["parameters"] + memory_breakdown(p)["optimizer state"] for k, p in mem.items()}
    assert state["dp(model) zero3"] < state["dp(model) zero1"] < state["dp(model)"]


def test_a_layout_over_the_budget_is_infeasible_and_says_what_overflows(wide) -> None:
    graph, cost, problems, auto = wide
    dp = layouts.data_parallel(graph, cost.mesh)
    budget = 1.5 * auto.peak_memory  # Megatron fits; replicated 64 MiB kernels and their moments do not
    priced = price_layout(graph, cost, dp, memory_budget=budget, time_budget_s=5, problems=problems)
    assert not priced.feasible
    assert priced.peak_memory > budget  # the plan is the completion without the budget: what it would need
    assert "over the" in priced.reason and "budget" in priced.reason and "largest there:" in priced.reason
    assert "MiB" in priced.reason and "(op " in priced.reason  # names the moment and the tensors live there
    tp = price_layout(graph, cost, layouts.megatron(graph, cost.mesh), memory_budget=budget, problems=problems,
                             time_budget_s=5)
    assert tp.feasible and tp.reason == ""


def test_rules_and_logical_axes_give_the_same_layout_as_megatron(wide) -> None:
    graph, cost, problems, auto = wide
    mesh = cost.mesh
    rules = [("*dense_0.kernel", PartitionSpec(None, "model")), ("*dense_0.bias", ("model",)),
             ("*dense_1.kernel", "S(model)·R"), ("batch.*", None)]
    by_rules = layouts.from_rules(graph, mesh, rules, name="by hand")
    annotations = [("*dense_0.kernel", ("embed", "mlp")), ("*dense_0.bias", ("mlp",)),
                   ("*dense_1.kernel", ("mlp", "embed")), ("*dense_1.bias", ("embed",))]
    logical = layouts.from_logical_axes(graph, mesh, annotations, [("mlp", "model"), ("embed", None)])
    megatron = layouts.megatron(graph, mesh)
    assert by_rules.specs == megatron.specs == logical.specs
    # a logical name used twice in one tensor takes the mesh axis once (MaxText's rule)
    twice = layouts.from_logical_axes(graph, mesh, [("*dense_0.kernel", ("mlp", "mlp"))], [("mlp", "model")])
    assert str(twice.specs["state.params.dense_0.kernel"]) == "S(model)·R"
    priced = price_layout(graph, cost, by_rules, time_budget_s=5, problems=problems)
    assert priced.step_time == pytest.approx(auto.predicted_step_time, rel=1e-9)


def test_layouts_that_cannot_be_expressed_are_refused_with_the_tensor_named(wide) -> None:
    graph, cost, problems, _ = wide
    with pytest.raises(PlanError, match=r"layout of v \[1020\].*not divisible"):
        layouts.to_spec(("model",), (1020,), cost.mesh, where="v")
    assert str(layouts.to_spec((("y", "x"),), (64,), CostModel.load("h100", mesh_shape=(2, 4), axis_names=(
        "x", "y")).mesh)) == "S(x,y)"  # axes within a dimension in mesh order, as the planner enumerates them
    with pytest.raises(PlanError, match="has more entries than dimensions"):
        layouts.from_rules(graph, cost.mesh, [("batch.x", (None, None, "model"))])
    with pytest.raises(PlanError, match="not an input of the step"):
        plan_graph(graph, cost, fixed={"state.params.dense_9.kernel": ShardingSpec.parse("R·R")}, problems=problems)
    with pytest.raises(PlanError, match="not in the mesh"):
        layouts.from_rules(graph, cost.mesh, [("batch.x", ("data",))])


def test_grid_on_a_2d_mesh_and_layouts_for_gpt() -> None:
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    mesh = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("x", "y")).mesh
    names = [lay.name for lay in layouts.grid(graph, mesh)]
    assert names == ["dp(x,y)", "dp(x,y) zero1", "dp(x,y) zero3", "dp(y) x tp(x)", "dp(y) x tp(x) zero1",
                     "dp(y) x tp(x) zero3", "dp(x) x tp(y)", "dp(x) x tp(y) zero1", "dp(x) x tp(y) zero3", "tp(x,y)"]
    lay = _specs(layouts.megatron(graph, mesh, "y", dp="x"))
    b0 = "state.params.block_0."
    assert lay[b0 + "attn.qkv.kernel"] == "R·S(y)" and lay[b0 + "attn.qkv.bias"] == "S(y)"
    assert lay[b0 + "attn.proj.kernel"] == "S(y)·R" and lay[b0 + "attn.proj.bias"] == "R"
    assert lay[b0 + "mlp.fc.kernel"] == "R·S(y)" and lay[b0 + "mlp.proj.kernel"] == "S(y)·R"
    assert lay["state.params.wte.embedding"] == "S(y)·R"  # vocab-parallel (the tied LM head with it)
    assert lay["state.params.wpe.embedding"] == "R·R" and lay[b0 + "ln_1.scale"] == "R"
    assert lay["batch.tokens"] == "S(x)·R"
    z3 = _specs(layouts.megatron(graph, mesh, "y", dp="x", zero=3))
    assert z3[b0 + "attn.qkv.kernel"] == "S(x)·S(y)"  # FSDP over x on the largest dimension left
    assert z3["state.opt_state[0].mu.block_0.attn.qkv.kernel"] == "S(x)·S(y)"
    # a batch of 8 cannot split 16 ways: the layout says so and splits it as far as it divides
    mesh16 = CostModel.load("h100", mesh_shape=(4, 4), axis_names=("x", "y")).mesh
    dp = layouts.data_parallel(graph, mesh16)
    assert str(dp.specs["batch.tokens"]) == "S(x)·R" and "does not divide over x,y" in dp.description


def test_a_fixed_layout_outside_the_planners_space_names_the_layouts_it_has() -> None:
    graph, cost = _mlp("tiny", ("x", "y"), (2, 4))
    with pytest.raises(PlanError, match=r"S\(y,x\)·R given for batch.x \[16, 32\] is not one autoshard can "
                                        r"express.*mesh order.*S\(x,y\)·R"):
        plan_graph(graph, cost, fixed={"batch.x": ShardingSpec.parse("S(y,x)·R")}, time_budget_s=2)


def test_hand_layouts_and_plans_as_starting_points_of_the_automatic_solve(wide) -> None:
    graph, cost, problems, auto = wide
    budget = 1.5 * auto.peak_memory
    starts = [layouts.megatron(graph, cost.mesh), layouts.data_parallel(graph, cost.mesh), auto]
    plan = plan_graph(graph, cost, memory_budget=budget, time_budget_s=6, problems=problems, starts=starts)
    costs = plan.solver.starts
    assert set(costs) == {"tp(model)", "plan 2"}  # data parallel does not fit the budget: no start
    assert plan.solver.objective <= min(costs.values()) * (1 + 1e-9)
    assert plan.predicted_step_time == pytest.approx(auto.predicted_step_time, rel=1e-9)
