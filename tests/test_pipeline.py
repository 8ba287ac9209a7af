"""Pipelined steps: partitioning rules, the stage planner, and numerics against the unsharded step."""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training.train_state import TrainState

import autoshard
from autoshard._examples import load_example
from autoshard.emit.program import global_rel_error
from autoshard.pipeline import (
    PipelineError,
    PipelinePlan,
    build_pipelined_step,
    explain_pipeline,
    format_pipeline_plan,
    microbatch_args,
    plan_pipeline,
    schedule,
)
from autoshard.pipeline.layer_prices import carried_assignment, plan_ops, price_layers, submesh_cost
from autoshard.pipeline.partition import (
    BACKWARD,
    FORWARD,
    UPDATE,
    assign_layers,
    default_num_layers,
    segments,
    split_step,
)
from autoshard.pipeline.recompute import recomputed, uniform
from autoshard.pipeline.stages import _ComposedMemory, _layouts, _static_memory, _submeshes
from autoshard.target import cost_model_for

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _example(name: str, preset: str = "tiny", **overrides):
    sets = [f"{k}={v}" for k, v in overrides.items()]
    return load_example(ROOT / "examples" / f"{name}.py", preset, sets, abstract=False)


def _compare(train_step, state, batch, *, steps: int = 2, **kw) -> PipelinePlan:
    """Run the step pipelined and plain for ``steps`` steps; losses and Adam moments (which carry the
    gradients) must agree to float32 precision every step."""
    piped = autoshard.parallelize(train_step, mesh=(2, 4), hardware="h100", pipeline=True, time_budget_s=5,
                                  **kw)
    ref = jax.jit(train_step)
    s_ref = s_pip = state
    for _ in range(steps):
        s_ref, m_ref = ref(s_ref, batch)
        s_pip, m_pip = piped(s_pip, batch)
        assert global_rel_error(m_ref, m_pip) <= TOL
        assert global_rel_error(s_ref.opt_state, s_pip.opt_state) <= TOL
    assert isinstance(piped.plan, PipelinePlan)
    return piped.plan


# ---- partitioning ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_micro():
    ex = _example("gpt")
    full = autoshard.trace(ex.train_step, *ex.args)
    micro = autoshard.trace(ex.train_step, *microbatch_args(ex.args, full, None, 4))
    return ex, full, micro


def test_step_splits_into_microbatched_and_update_parts(gpt_micro) -> None:
    _, full, g = gpt_micro
    parts = split_step(g)
    assert parts.ops(FORWARD) and parts.ops(BACKWARD) and parts.ops(UPDATE)
    # the batch is traced at a quarter of its rows
    (b,) = parts.batch_inputs
    assert g.tensors[g.inputs[b]].shape[0] * 4 == full.tensors[full.inputs[b]].shape[0]
    # what leaves the gradient computation: the loss and one gradient per parameter (same shapes)
    params = [g.tensors[t] for t in g.inputs if g.tensors[t].role.value == "param"]
    acc = [g.tensors[t] for t in parts.accumulated]
    assert sum(t.shape == () for t in acc) >= 1
    assert sorted(t.shape for t in acc if t.shape != ()) == sorted(t.shape for t in params if t.shape != ())
    # no update op reads the batch
    batch = {g.inputs[i] for i in parts.batch_inputs}
    assert not any(set(g.ops[i].inputs) & batch for i in parts.ops(UPDATE))


def test_layers_keep_dependencies_pointing_the_right_way(gpt_micro) -> None:
    _, _, g = gpt_micro
    parts = split_step(g)
    layer = assign_layers(g, parts, 4)
    fwd = parts.ops(FORWARD)
    assert [layer[i] for i in fwd] == sorted(layer[i] for i in fwd)  # contiguous, in schedule order
    assert set(layer[i] for i in fwd) == {0, 1, 2, 3}
    for op in g.ops:
        for t in op.inputs:
            p = g.tensors[t].producer
            if p is None:
                continue
            if parts.kind[op.id] == FORWARD and parts.kind[p] == FORWARD:
                assert layer[p] <= layer[op.id]
            if parts.kind[op.id] == BACKWARD and parts.kind[p] == BACKWARD:
                assert layer[p] >= layer[op.id], f"{op.where()} waits on a later stage's backward"


def test_a_step_without_gradient_cannot_be_pipelined() -> None:
    def step(params, batch):
        return params, {"y": jnp.sum(batch["x"] @ params["w"])}

    g = autoshard.trace(step, {"w": jnp.ones((4, 4))}, {"x": jnp.ones((8, 4))})
    with pytest.raises(PipelineError, match=r"no jax\.grad"):
        split_step(g)


def test_an_update_that_reads_the_batch_is_refused_with_the_op_named() -> None:
    def step(params, batch):
        loss, g = jax.value_and_grad(lambda p: jnp.mean(batch["x"] @ p["w"]))(params)
        seen = jnp.sum(batch["x"])  # per-example data used outside the gradient
        return jax.tree.map(lambda p, d: p - 0.1 * d * seen, params, g), {"loss": loss}

    g = autoshard.trace(step, {"w": jnp.ones((4, 4))}, {"x": jnp.ones((8, 4))})
    with pytest.raises(PipelineError, match=r"reads the batch input .*outside the gradient"):
        split_step(g)


def test_microbatch_count_must_divide_the_batch(gpt_micro) -> None:
    ex, full, _ = gpt_micro
    with pytest.raises(PipelineError, match="not divisible into 3 microbatches"):
        microbatch_args(ex.args, full, None, 3)


# ---- the planner -----------------------------------------------------------------------------------------


def test_pipeline_plan_round_trips_and_explains_itself(gpt_micro, tmp_path: Path) -> None:
    _, _, g = gpt_micro
    cost = cost_model_for("h100", (2, 4), ("x", "y"))
    plan = plan_pipeline(g, cost, hardware="h100", num_microbatches=4, num_layers=4, time_budget_s=5,
                         stage_shape=(1, 4))
    assert [st.submesh for st in plan.stages] == [(1, 4), (1, 4)]
    assert sorted(d for st in plan.stages for d in st.devices(plan.cluster)) == list(range(8))
    assert plan.stages[0].layers[0] == 0 and plan.stages[-1].layers[1] == 3
    # step time: the pipeline formula over the stages' times, or the host issuing the MPMD runtime's programs
    # where that takes longer (``pipeline.host``: on an H100 this tiny model's stages take microseconds), plus
    # the slowest update
    t = [st.micro_time for st in plan.stages]
    assert plan.host_time > sum(t) + 3 * max(t)
    assert plan.predicted_step_time == pytest.approx(max(sum(t) + 3 * max(t), plan.host_time)
                                                     + max(st.update_time for st in plan.stages))
    assert 0 < plan.bubble_fraction < 1
    path = tmp_path / "pipe.json"
    plan.save(path)
    back = PipelinePlan.load(path)
    assert back.to_dict() == plan.to_dict()
    back.verify(g)
    text = format_pipeline_plan(plan)
    assert "2 stages, 4 microbatches, schedule 1f1b" in text and "bubble" in text
    # the program both runtimes run, saved with the plan (a pure function of its fields) and drawn by explain;
    # the MPMD runtime walks that program
    assert back.program == plan.program == schedule("1f1b", 2, 4)
    assert "\n".join("  " + row for row in str(plan.program).splitlines()) in explain_pipeline(plan)
    assert build_pipelined_step(g, plan, jax.devices()).schedule == plan.program
    with pytest.raises(PipelineError, match="stage_shape"):
        plan_pipeline(g, cost, num_microbatches=4, stage_shape=(1, 3))


def _four_layers(g: autoshard.Graph) -> tuple[list[list[int]], list[list[int]]]:
    """The microbatched and the update op ids of each of ``g``'s 4 layers."""
    parts = split_step(g)
    layer_of = assign_layers(g, parts, 4)
    micro = [[o.id for o in g.ops if layer_of[o.id] == ell and parts.kind[o.id] != UPDATE] for ell in range(4)]
    update = [[o.id for o in g.ops if layer_of[o.id] == ell and parts.kind[o.id] == UPDATE] for ell in range(4)]
    return micro, update


def test_a_stage_of_layers_holds_what_their_plans_joined_hold(gpt_micro) -> None:
    # the check behind the DP's re-cut (stages._ComposedMemory): one layer joined alone holds what its
    # own plan reported, and a stage of two layers at least as much as its larger layer
    _, _, g = gpt_micro
    cost = cost_model_for("h100", (2, 4), ("x", "y"))
    micro, update = _four_layers(g)
    costs = [submesh_cost(cost, (1, 4))]
    # one microbatch in flight everywhere, so every layer was planned with its activations counted once
    prices = price_layers(g, micro, update, costs, "h100", None, 2.0, (1, 1), 8, num_microbatches=4)
    composed = _ComposedMemory(g, prices, micro, update, costs, 4)
    for ell in range(4):
        part = prices.parts[ell][0]
        assert composed(ell, ell, 0, 1) == pytest.approx(part.memory, rel=1e-6), ell
    assert composed(1, 2, 0, 1) >= max(prices.parts[ell][0].memory for ell in (1, 2)) * (1 - 1e-6)
    assert composed(1, 2, 0, 3) > composed(1, 2, 0, 1)  # three microbatches' activations held


def test_a_stage_holds_its_layers_activations_once_per_microbatch_and_one_layers_temporaries(gpt_micro) -> None:
    """A layer's microbatch plan peaks at ``weight`` x its held activations plus temporaries its pass needs
    one layer at a time; a stage's static memory adds the largest of those, not their sum (summed, GPT-39B
    as one stage of 48 blocks priced 245 GB)."""
    _, _, g = gpt_micro
    cost = cost_model_for("h100", (2, 4), ("x", "y"))
    micro, update = _four_layers(g)
    prices = price_layers(g, micro, update, [submesh_cost(cost, (1, 4))], "h100", None, 2.0, (3, 3), 8,
                          num_microbatches=4)
    transient = prices.micro_transient
    for ell in range(4):
        peak = prices.parts[ell][0].micro.memory
        assert prices.micro_memory[ell, 0] > 0 and transient[ell, 0] >= 0
        assert 3 * prices.micro_memory[ell, 0] + transient[ell, 0] == pytest.approx(peak, rel=1e-9), ell
    static = _static_memory(prices)
    assert static[0, 3, 0] == pytest.approx(prices.update_memory[:, 0].sum() + transient[:, 0].max(), rel=1e-9)
    assert static[1, 2, 0] == pytest.approx(prices.update_memory[1:3, 0].sum() + transient[1:3, 0].max(), rel=1e-9)


def test_a_recomputed_block_runs_its_backward_in_its_own_layer() -> None:
    # full recompute replays each block from its input, a value of the layer before; by the min rule
    # alone the replay and the whole backward that reads it ran a layer down (GPT-1T: the first layer held
    # two blocks' backward, the last none). Every block's matmuls, forward and backward, share a layer.
    ex = _example("gpt", layers=4)
    full = autoshard.trace(ex.train_step, *ex.args)
    g = autoshard.trace(ex.train_step, *microbatch_args(ex.args, full, None, 4))
    g = recomputed(g, uniform(g, "full"))
    parts = split_step(g)
    layer_of = assign_layers(g, parts, 4)
    where: dict[tuple[str, bool], set[int]] = {}
    for op in g.ops:
        if op.primitive == "dot_general" and op.layer and "block_" in op.layer:
            where.setdefault((op.layer, parts.kind[op.id] == FORWARD), set()).add(layer_of[op.id])
    blocks = sorted({b for b, _ in where})
    assert len(blocks) == 4
    assert [where[(b, True)] for b in blocks] == [{0}, {1}, {2}, {3}]
    assert [where[(b, False)] for b in blocks] == [{0}, {1}, {2}, {3}]


def test_a_planned_layer_carries_its_layouts_to_the_copies_of_its_ops_in_another_layer() -> None:
    # GPT of 4 blocks cut into 5 layers: layers 1..3 are copies (the end of one block and the start of
    # the next), layer 4 is the rest of block 3 and the head. A plan of layer 2 carried to layer 3 is
    # layer 2's plan: started there, layer 3's solve is as good with no time to search. Carried to layer 4,
    # it covers the ops the two share (the block's), and is a start the solve prices.
    ex = _example("gpt", layers=4)
    full = autoshard.trace(ex.train_step, *ex.args)
    g = autoshard.trace(ex.train_step, *microbatch_args(ex.args, full, None, 4))
    parts = split_step(g)
    layer_of = assign_layers(g, parts, 5)
    micro = [[o.id for o in g.ops if layer_of[o.id] == ell and parts.kind[o.id] != UPDATE] for ell in range(5)]
    assert len(micro[1]) == len(micro[2]) == len(micro[3]) != len(micro[4])
    cost = submesh_cost(cost_model_for("h100", (2, 4), ("x", "y")), (1, 4))
    source = plan_ops(g, micro[2], cost, "h100", None, 2.0)
    same = carried_assignment(g, source, micro[2], micro[3])
    assert len(same) == len(carried_assignment(g, source, micro[2], micro[2])) > 0
    copy = plan_ops(g, micro[3], cost, "h100", None, 0.0, starts=[same])
    assert copy.plan.solver.starts and min(copy.plan.solver.starts.values()) <= source.plan.solver.objective * (1 + 1e-9)
    assert copy.time <= source.time * (1 + 1e-6)
    other = carried_assignment(g, source, micro[2], micro[4])
    assert len(same) / 3 < len(other) < len(same)  # the block's ops match, the head's do not
    last = plan_ops(g, micro[4], cost, "h100", None, 0.5, starts=[other])
    assert last.plan.solver.starts and all(v < float("inf") for v in last.plan.solver.starts.values())


# ---- numerics --------------------------------------------------------------------------------------------


def test_gpt_two_stages_of_four_match_the_unsharded_step() -> None:
    ex = _example("gpt")
    plan = _compare(ex.train_step, *ex.args, microbatches=4, stage_shape=(1, 4), num_layers=4)
    assert len(plan.stages) == 2


def test_one_host_submeshes_are_also_priced_as_2d_logical_meshes() -> None:
    assert _layouts([(1, 1), (1, 2), (1, 8), (2, 8)]) == (
        ((1, 1), None), ((1, 2), None), ((1, 8), None), ((1, 8), (2, 4)), ((1, 8), (4, 2)), ((2, 8), None))
    cost = cost_model_for("h100", (8, 8), ("x", "y"))
    flat, square = submesh_cost(cost, (1, 8)), submesh_cost(cost, (1, 8), (2, 4))
    assert flat.mesh.shape == (8,) and square.mesh.shape == (2, 4) and square.mesh.axis_names == ("y0", "y1")
    assert square.mesh.links == (flat.mesh.links[0],) * 2  # both axes inside the host
    with pytest.raises(ValueError, match="not a 2-D layout"):
        submesh_cost(cost, (2, 8), (4, 4))


def test_stage_shapes_include_host_counts_that_split_the_microbatch_rows() -> None:
    """GPT-1T's 3-row microbatches on 384 hosts: a 3-host stage splits the rows over its hosts (Megatron's
    data parallel), which no power-of-two host count does; counts that divide the hosts but not the rows
    (6, 12) stay out, and a mesh whose rows are powers of two keeps Alpa's powers of two alone."""
    shapes = _submeshes((384, 8), None, rows=3)
    assert (3, 8) in shapes and (6, 8) not in shapes and (12, 8) not in shapes
    assert {h for h, _ in shapes if h > 1} == {2, 3, 4, 8, 16, 32, 64, 128, 256, 384}
    assert {h for h, _ in _submeshes((384, 8), None, rows=6)} >= {3, 6}
    assert _submeshes((8, 8), None, rows=8) == _submeshes((8, 8), None)


def test_a_deep_stack_gets_a_layer_per_block() -> None:
    """70 blocks: 71 layers (a block per layer and the ops around them), so that a stage can hold one
    block; the old cap of 64 forced two blocks per layer on GPT-1T's 128."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=70", "batch=2", "seq_len=16"], abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    assert default_num_layers(graph, split_step(graph)) == 71


def test_wide_resnet_four_stages_of_two_gpipe_match_the_unsharded_step() -> None:
    ex = _example("wide_resnet")
    plan = _compare(ex.train_step, *ex.args, microbatches=8, schedule="gpipe", stage_shape=(1, 2), num_layers=4)
    assert len(plan.stages) == 4 and plan.schedule == "gpipe"


class _Skip(nn.Module):
    """Four dense layers whose input is also added to the last one's output: a skip over every stage."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = x
        for i in range(4):
            h = jnp.tanh(nn.Dense(32, name=f"dense_{i}")(h))
        return jnp.mean((h + x) ** 2)


def test_a_skip_connection_across_stages_is_carried_to_the_stage_that_reads_it() -> None:
    model = _Skip()
    x = jax.random.normal(jax.random.key(0), (16, 32))
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(1), x)["params"],
                              tx=optax.adam(1e-2))
    state = state.replace(step=jnp.zeros((), jnp.int32))

    def train_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: state.apply_fn({"params": p}, batch["x"]))(state.params)
        with jax.numpy_dtype_promotion("standard"):
            return state.apply_gradients(grads=grads), {"loss": loss}

    plan = _compare(train_step, state, {"x": x}, steps=3, microbatches=4, stage_shape=(1, 2), num_layers=4)
    assert len(plan.stages) == 4
    # the batch input x is read by the first and the last stage's forward programs
    full = autoshard.trace(train_step, state, {"x": x})
    g = autoshard.trace(train_step, *microbatch_args((state, {"x": x}), full, None, 4))
    parts = split_step(g)
    (b,) = parts.batch_inputs
    readers = {seg.stage for seg in segments(g, parts, plan.stage_of_op())
               if seg.kind == FORWARD and g.inputs[b] in seg.inputs}
    assert {0, 3} <= readers


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "wide_resnet"])
@pytest.mark.parametrize("shape", [(1, 4), (1, 2)])
@pytest.mark.parametrize("micro", [4, 8])
@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
def test_pipelines_match_the_unsharded_step(name: str, shape: tuple[int, int], micro: int, sched: str) -> None:
    ex = _example(name)
    _compare(ex.train_step, *ex.args, steps=3, microbatches=micro, schedule=sched, stage_shape=shape,
             num_layers=4)


def test_pipeline_stage_regions_force_layer_boundaries() -> None:
    class Marked(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            with autoshard.pipeline_stage("front"):  # one small layer the clustering would not cut out
                x = jnp.tanh(nn.Dense(8, name="small")(x))
            with autoshard.pipeline_stage("back"):
                for i in range(3):
                    x = jnp.tanh(nn.Dense(64, name=f"big_{i}")(x))
            return jnp.mean(x**2)

    model = Marked()
    x = jnp.ones((16, 64))
    params = model.init(jax.random.key(0), x)["params"]

    def step(params, batch):
        loss, g = jax.value_and_grad(lambda p: model.apply({"params": p}, batch["x"]))(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), {"loss": loss}

    g = autoshard.trace(step, params, {"x": x})
    parts = split_step(g)
    layer = assign_layers(g, parts, 2)
    fwd_dots = [op for op in g.ops if op.primitive == "dot_general" and parts.kind[op.id] == FORWARD]
    assert [layer[op.id] for op in fwd_dots] == [0, 1, 1, 1]
    assert "autoshard_stage_front" in fwd_dots[0].scope
