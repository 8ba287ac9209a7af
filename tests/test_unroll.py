"""A layer stack written as one scan, unrolled into numbered blocks (``autoshard.trace.unroll``): for the
pipeline, and for the intra-operator plan, which runs it so (``PlanOptions.unroll_scans``)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.emit import global_rel_error
from autoshard.planner.plan import Plan, PlanError
from autoshard.trace import trace
from autoshard.trace.unroll import layer_stacks, unroll_layer_stacks

sys.path.insert(0, str(Path(__file__).parent / "workers"))
from pipeline_forms import make


def _run(graph, leaves):
    return jax.jit(jax.extend.core.jaxpr_as_fun(graph.jaxpr))(*leaves)


def test_a_layer_stack_becomes_numbered_blocks_that_compute_the_same_step() -> None:
    fn, args, batch = make("optax:scan")
    graph = trace(fn, *args, batch)
    assert len(layer_stacks(graph)) == 2  # the forward scan and the backward pass's
    flat = unroll_layer_stacks(graph)
    assert not layer_stacks(flat) and not [op for op in flat.ops if op.primitive == "scan"]
    tags = {phase: sorted({op.layer for op in flat.ops if op.phase == phase and op.layer})
            for phase in ("forward", "backward")}
    assert tags["forward"] == tags["backward"] == [f"GPT.loss/GPT/blocks_{j}" for j in range(4)]
    # the same work (plus what JAX hoisted out of the body, made again in each block: broadcasts), the same
    # inputs and outputs, the same numbers
    assert graph.total_flops <= flat.total_flops <= 1.001 * graph.total_flops
    assert [flat.tensors[t].name for t in flat.inputs] == [graph.tensors[t].name for t in graph.inputs]
    assert flat.output_names == graph.output_names and flat.output_aliases == graph.output_aliases
    leaves = jax.tree.leaves((*args, batch))
    # the same ops associated otherwise (a scan body against four copies): float32 rounding, whose size
    # depends on the CPU's vector width; 1e-6 held on earlier VMs and measured 1.01e-6 on 2026-11-28's (each
    # leaf within 7e-7, a few float32 ulps), so the project's bound for equal maths in another order
    assert global_rel_error(_run(graph, leaves), _run(flat, leaves)) <= 1e-5


def test_residuals_go_from_a_block_to_its_backward_and_only_the_gradients_are_stacked() -> None:
    fn, args, batch = make("state:scan")
    flat = unroll_layer_stacks(trace(fn, *args, batch))
    block = {op.id: op.layer for op in flat.ops if op.layer}

    def origin(tid: int) -> int | None:
        """The op that made ``tid``, through the leading axis each slice is given to be stacked."""
        p = flat.tensors[tid].producer
        while p is not None and flat.ops[p].primitive in ("broadcast_in_dim", "expand_dims", "reshape") \
                and not flat.ops[p].layer:
            p = flat.tensors[flat.ops[p].inputs[0]].producer
        return p

    for op in flat.ops:
        if op.primitive not in ("stack", "concatenate"):
            continue
        sources = {block.get(origin(t)) for t in op.inputs}
        if len(sources - {None}) > 1:  # only the optimizer stacks values of several blocks: the gradients
            assert op.phase == "other", op.where()
    # each block's weights are its row of the stack, cut once outside the blocks
    rows = [op for op in flat.ops if op.primitive == "slice" and flat.tensors[op.inputs[0]].name.startswith(
        "state.params.blocks.")]
    assert len(rows) == 12 * 4 and not any(op.layer for op in rows)


def test_a_scan_over_time_with_its_weights_as_constants_is_left_alone() -> None:
    def step(params, xs):
        def loss(p):
            def cell(h, x):
                h = jnp.tanh(h @ p["w"] + x)
                return h, h.sum()
            _, ys = jax.lax.scan(cell, jnp.zeros(4), xs)
            return ys.sum()
        g = jax.grad(loss)(params)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g), 0.0

    params = {"w": np.eye(4, dtype=np.float32)}
    graph = trace(step, params, np.ones((6, 4), np.float32))
    assert layer_stacks(graph) == [] and unroll_layer_stacks(graph) is graph


def test_a_scanned_step_is_planned_and_run_unrolled_and_its_saved_plan_too(tmp_path) -> None:
    """By default the intra-operator plan unrolls the stack, says so, prices it below the scan it replaces
    (XLA fuses across the layers unrolled; a scan writes what it keeps for the backward pass into stacked
    buffers), runs it as ``jax.jit`` runs the step, and a saved plan runs again on the step as written."""
    fn, args, batch = make("optax:scan")
    step = autoshard.parallelize(fn, mesh=(2, 4), hardware="h100", time_budget_s=4)  # priced for GPUs, run here
    ref = jax.jit(fn)
    got = want = (*args, batch)
    for _ in range(3):
        want = (*ref(*want[:-1], batch)[:-1], batch)
        out = step(*got[:-1], batch)
        assert global_rel_error(want[:-1], out[:-1]) <= 1e-5
        got = (*out[:-1], batch)
    plan = step.plan
    assert plan.unrolled and not [op for op in step.graph.ops if op.primitive == "scan"]
    assert "layer stack: the scan is unrolled" in step.explain()
    kept = autoshard.plan(fn, *args, batch, mesh=(2, 4), hardware="h100", time_budget_s=4, unroll_scans=False)
    assert not kept.unrolled and any(len(scope) for scope in kept.specs)  # layouts inside the scan's body
    assert plan.predicted_step_time < 0.9 * kept.predicted_step_time

    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded.unrolled
    with pytest.raises(PlanError, match="unroll_scans=False"):
        loaded.verify(trace(fn, *args, batch))  # the scan as written: not what the plan's tensors are
    again = autoshard.parallelize(fn, mesh=(2, 4), plan=path)
    fresh = jax.tree.map(np.asarray, (*args, batch))
    out, ref_out = again(*fresh), ref(*fresh)
    assert global_rel_error(ref_out[:-1], out[:-1]) <= 1e-5


def test_a_scanned_stack_recomputing_holds_what_the_unrolled_model_holds() -> None:
    # JAX's backward of a scanned block starts by rebuilding its causal mask from an iota, reading no value
    # of the backward pass: the recompute's replay must still wait for the incoming cotangent (its anchor),
    # and its barriers are not fused into the forward matmuls they copy. A replay tied to nothing was
    # merged into them, and the stack held each block's saved matmul outputs twice: on GPT-125M at batch
    # 1024 x 1024 on 2x4, 107.2 GiB held with every block selective, against 66.4 GiB written unrolled.
    # Here on one device (no layout to choose), with activations large beside the weights (each layer's
    # weights, sliced from the stack once for its forward and backward pass, are held between them, where
    # the example reads its parameters in place): 82.8 MB held before, against 44.2 MB unrolled
    plans = {}
    for form in ("optax", "optax:scan"):
        fn, args, batch = make(form, batch=32, seq_len=128)
        plans[form] = autoshard.plan(fn, *args, batch, mesh=(1, 1), hardware="h100", recompute="selective",
                                     memory_budget=None, time_budget_s=3)
    scanned, unrolled = plans["optax:scan"], plans["optax"]
    assert scanned.unrolled and set(scanned.recompute.values()) == {"selective"}
    assert scanned.held_memory == pytest.approx(unrolled.held_memory, rel=0.02)
    assert scanned.peak_memory == pytest.approx(unrolled.peak_memory, rel=0.02)
