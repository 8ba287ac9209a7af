"""Plans explain themselves: layouts per class and layer, time and memory by category, where the time goes,
and why a tensor got its layout (each alternative priced)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.cli import main
from autoshard.pipeline import PipelinePlan, PipelineReport, StagePlan, explain_pipeline
from autoshard.planner.explain import (
    explain_plan,
    explain_tensor,
    layer_layouts,
    memory_breakdown,
)
from autoshard.planner.plan import Plan, PlanError, TensorLayout
from autoshard.planner.planning import plan_graph
from cost_models import CostModel, ShardingSpec

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wide():
    """examples/mlp.py "wide" on 8 devices: the Megatron pair (column-parallel dense_0, row-parallel dense_1)."""
    ex = load_example(ROOT / "examples" / "mlp.py", "wide", abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    cost = CostModel.load("h100", mesh_shape=(8,), axis_names=("model",))
    return graph, cost, plan_graph(graph, cost, hardware="h100", time_budget_s=10)


def test_explain_names_the_spec_of_each_class_and_the_time_adds_up(wide) -> None:
    _, _, plan = wide
    e = explain_plan(plan)
    by_class = {(c.name, c.shape): c for c in e.classes}
    assert by_class[("state.params.dense_*.kernel", (1024, 16384))].specs == {"R·S(model)": 1}
    assert by_class[("state.params.dense_*.kernel", (16384, 1024))].spec == "S(model)·R"
    # Adam's moments mirror their parameters (both mu and nu fold into one class each)
    assert by_class[("state.opt_state[*].mu.dense_*.kernel", (1024, 16384))].spec == "R·S(model)"
    # the rows add up to the step time; resharding is inside the collectives, not added again
    assert math.fsum(v for _, v in e.time) == pytest.approx(plan.predicted_step_time, rel=1e-12)
    assert dict(e.time)["all_reduce(model)"] == pytest.approx(e.resharding)
    assert "resharding" not in dict(e.time)
    # per layer: dense_0 column-parallel with its bias, dense_1 row-parallel with a whole bias
    layers = {g.layers[0]: dict(g.specs) for g in e.layers}
    assert layers["dense_0"] == {"bias": "S(model)", "kernel": "R·S(model)"}
    assert layers["dense_1"] == {"bias": "R", "kernel": "S(model)·R"}
    text = autoshard.explain(plan)
    assert "R·S(model)" in text and "all_reduce(model)" in text and "gradients (estimate)" in text


def test_memory_rows_are_exact_for_the_state_and_add_up_to_the_peak(wide) -> None:
    _, _, plan = wide
    m = memory_breakdown(plan)
    # parameters: both kernels split 8 ways, dense_0's bias split, dense_1's whole (float32)
    params = 4 * (2 * 1024 * 16384 / 8 + 16384 / 8 + 1024)
    assert m["parameters"] == pytest.approx(params)
    assert m["optimizer state"] == pytest.approx(2 * params + 4)  # mu, nu and Adam's int32 count
    assert m["gradients (estimate)"] == m["parameters"]
    assert m["batch"] == pytest.approx(2 * 16 * 1024 * 4)  # x and y, replicated (Megatron)
    assert math.fsum(m.values()) == pytest.approx(plan.peak_memory)
    assert m["activations (estimate)"] > 0


def test_top_ops_name_the_op_and_its_source_line_and_survive_json(wide, tmp_path: Path) -> None:
    _, _, plan = wide
    top = plan.solver.top_ops
    assert top and [g["time"] for g in top] == sorted((g["time"] for g in top), reverse=True)
    assert all("examples/mlp.py:" in g["source"] and "(op " in g["op"] for g in top)
    assert math.fsum(g["time"] for g in top) <= plan.predicted_step_time * (1 + 1e-9)
    # the row-parallel pair's all-reduce shows up as resharding into the op that reads its result
    assert any(g["resharding"] == pytest.approx(plan.time_breakdown["all_reduce(model)"]) for g in top)
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.solver.top_ops == top and again.to_dict() == plan.to_dict()
    text = explain_plan(again, top=3).text()
    assert text.count("examples/mlp.py:") >= 3


def test_per_layer_view_folds_runs_of_identical_layers(wide) -> None:
    _, _, plan = wide
    mesh_spec = {"a": ShardingSpec.parse("R·S(model)"), "b": ShardingSpec.parse("S(model)·R")}

    def lay(i: int, spec: str) -> TensorLayout:
        return TensorLayout(name=f"state.params.block_{i}.mlp.fc.kernel", shape=(8, 8), dtype="float32",
                            role="param", spec=mesh_spec[spec])

    inputs = (*(lay(i, "a") for i in range(3)), lay(3, "b"), *(lay(i, "a") for i in range(4, 12)))
    groups = layer_layouts(dataclasses.replace(plan, inputs=inputs))
    assert [g.layers for g in groups] == [
        ("block_0", "block_1", "block_2"), ("block_3",), tuple(f"block_{i}" for i in range(4, 12))]
    assert groups[1].specs == (("mlp.fc.kernel", "S(model)·R"),)
    assert groups[2].label == "block_4..block_11 (8 layers)"


def test_why_a_megatron_kernel_is_split_by_columns(wide) -> None:
    graph, cost, plan = wide
    why = explain_tensor(graph, plan, cost, "state.params.dense_0.kernel", resolve=True, time_budget_s=6)
    assert why.chosen.spec == "R·S(model)"
    assert why.cheapest is why.chosen
    specs = {a.spec for a in why.alternatives}
    assert specs == {"R·S(model)", "S(model)·R", "R·R"}  # every layout of a [1024, 16384] kernel on 8 devices
    others = [a for a in why.alternatives if not a.chosen]
    assert all(a.time > why.chosen.time for a in others)
    replicated = next(a for a in why.alternatives if a.spec == "R·R")
    assert replicated.memory == pytest.approx(8 * why.chosen.memory)  # the whole kernel on every device
    # forcing an alternative and re-solving everything else never beats the plan
    assert why.chosen.step_time == pytest.approx(plan.predicted_step_time)
    assert all(a.step_time >= plan.predicted_step_time * (1 - 1e-9) for a in others)
    text = why.text()
    assert "why is state.params.dense_0.kernel" in text and "the chosen strategy is the cheapest" in text


def test_why_for_an_op_result_and_for_a_plan_without_a_recorded_choice(wide) -> None:
    graph, cost, plan = wide
    dot = next(op for op in graph.ops if op.primitive == "dot_general" and "dense_1" in op.scope
               and op.phase == "forward")
    name = graph.tensors[dot.outputs[0]].name
    why = explain_tensor(graph, plan, cost, name)
    assert why.chosen.spec == "R·R +P(model)"  # the row-parallel matmul leaves a pending sum
    assert why.cheapest is why.chosen
    assert "R·S(model)" in why.chosen.reads and "S(model)·R" in why.chosen.reads
    # older plans carry no choice: the specs are matched back onto strategies, with the same answer
    bare = dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, choice=""))
    again = explain_tensor(graph, bare, None, name)
    assert [a.spec for a in again.alternatives] == [a.spec for a in why.alternatives]
    assert again.chosen.spec == why.chosen.spec and not again.notes
    with pytest.raises(PlanError, match="no tensor named"):
        explain_tensor(graph, plan, cost, "state.params.nope")


def test_pipeline_explain_splits_work_bubble_and_update(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mesh = CostModel.load("h100", mesh_shape=(1, 4), axis_names=("x", "y")).mesh

    def stage(i: int, t: float) -> StagePlan:
        return StagePlan(layers=(i, i), submesh=(1, 4), origin=(0, 4 * i), mesh=mesh, micro_time=t,
                         update_time=0.5e-3, memory=1e9, specs={}, update_specs={})

    stages = (stage(0, 1e-3), stage(1, 2e-3))
    pipe = 3e-3 + 3 * 2e-3
    pp = PipelinePlan(mesh=CostModel.load("h100", mesh_shape=(1, 8), axis_names=("x", "y")).mesh,
                      hardware="h100", num_microbatches=4, schedule="1f1b", num_layers=2, stages=stages,
                      layer_of_op=(), predicted_step_time=pipe + 0.5e-3,
                      bubble_fraction=1 - 3e-3 * 4 / (2 * pipe), peak_memory=1e9, memory_budget=None,
                      solver=PipelineReport(dp_cost=0.0, layer_solves=0, distinct_layers=0, dp_seconds=0.0,
                                            dp_candidates=0, stage_costing_seconds=0.0, planning_seconds=0.0),
                      graph_digest="")
    text = explain_pipeline(pp)
    assert "pipeline bubble" in text and "3.00 ms" in text  # 9 ms of pipeline, 6 ms of work per stage
    assert "stage work (mean per stage)" in text and "6.00 ms" in text
    path = tmp_path / "pipe.json"
    pp.save(path)
    assert main(["explain", str(path)]) == 0
    assert "pipeline bubble" in capsys.readouterr().out


def test_cli_explain_with_why_and_json(wide, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, plan = wide
    path, out = tmp_path / "plan.json", tmp_path / "explain.json"
    plan.save(path)
    rc = main(["explain", str(path), "--graph", str(ROOT / "examples" / "mlp.py"), "--preset", "wide",
               "--why", "state.params.dense_1.kernel", "--top", "3", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "time by category" in text and "why is state.params.dense_1.kernel" in text
    data = json.loads(out.read_text())
    chosen = [a for a in data["why"][0]["alternatives"] if a["chosen"]]
    assert chosen[0]["spec"] == "S(model)·R"
    assert len(data["plan"]["top_ops"]) == 3
    assert main(["explain", str(path), "--why", "t1"]) == 2
    assert "--why needs --graph" in capsys.readouterr().err


@pytest.mark.parametrize("style", ["numbered", "flax_default", "nnx_list"])
def test_layer_indices_fold_in_the_names_models_give_them(wide, style: str) -> None:
    """The summary's classes, the per-layer view and the top ops fold a layer's index however the model
    names its layers (the example's ``block_3``; ``h['3']``, flax's ``Block_3``, an nnx list's ``blocks[3]``,
    a scope's ``layers/3``): the style models' real names, traced, give the example's classes and layers."""
    import style_models as sm

    from autoshard.planner.summary import fold_layer_indices
    from autoshard.trace.graph import Role

    def params(name: str) -> list[str]:
        s = sm.STYLES[name]
        return [t.name for t in autoshard.trace(s.train_step, *s.make("tiny", abstract=True)).input_tensors(Role.PARAM)]

    example, mine = params("example"), params(style)
    assert len({fold_layer_indices(n) for n in mine}) == len({fold_layer_indices(n) for n in example}) < len(example)
    _, _, plan = wide
    spec = ShardingSpec.parse("R")

    def layers(names: list[str]) -> list[tuple[str, ...]]:
        inputs = tuple(TensorLayout(name=n, shape=(8,), dtype="float32", role="param", spec=spec) for n in names)
        return [g.layers for g in layer_layouts(dataclasses.replace(plan, inputs=inputs))]

    got, want = layers(mine), layers(example)
    assert len(got) == len(want) == 1 and len(got[0]) == len(want[0]) == sm.STYLES[style].PRESETS["tiny"].layers
    assert fold_layer_indices("Llama.loss/Llama/layers/31/self_attn") == "Llama.loss/Llama/layers/*/self_attn"
    assert fold_layer_indices("state.params.ln_f.scale") == "state.params.ln_f.scale"


def test_blocks_with_no_number_in_their_names_fold_by_the_names_that_tell_them_apart() -> None:
    """``self.first = Block(); self.second = Block()``: the structure finds the two blocks, and the plan records
    each input's class with the name that tells its block apart folded (``blocks.*.attn.qkv.kernel``), so the
    summary, explain and compare list the example's classes; the class survives the plan's JSON."""
    import style_models as sm

    from autoshard.planner.explain import class_layouts
    from autoshard.planner.summary import fold_layer_indices, input_class
    from autoshard.trace.graph import Role

    def traced(name: str):
        s = sm.STYLES[name]
        return autoshard.trace(s.train_step, *s.make("tiny", abstract=True))

    example = {fold_layer_indices(t.name) for t in traced("example").input_tensors(Role.PARAM)}
    plan = autoshard.plan(traced("unnumbered"), mesh=(2, 4), hardware="h100", time_budget_s=3)
    params = [t for t in plan.inputs if t.role == "param"]
    assert len({input_class(t) for t in params}) == len(example)
    assert any(input_class(t) == "state.params.blocks.*.attn.qkv.kernel" for t in params)
    assert len([c for c in class_layouts(plan) if c.role == "param"]) == len(example)
    assert Plan.from_dict(plan.to_dict()).inputs == plan.inputs
