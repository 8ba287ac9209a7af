"""Ops the planner cannot see into (``autoshard.strategies.custom``): ``shard_map`` regions, ``custom_partitioning``
calls, registered custom kernels and ``reshard``. For each: the plan around it (fixed layouts kept, no
missing-rule warning) and the emitted program run with ``parallelize`` on a 2x4 mesh against ``jax.jit``
(one global relative norm, 1e-5)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.planner.build import build_problem
from autoshard.strategies import RuleContext, custom, strategies_for
from autoshard.target import PlanningError
from autoshard.trace import unruled
from cost_models import CostModel, ShardingSpec

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
MESH = {"x": 2, "y": 4}


def _spec(text: str) -> ShardingSpec:
    """``"x,-"`` -> dimension 0 split over x, dimension 1 whole."""
    return ShardingSpec(dims=tuple(() if d == "-" else tuple(d.split("+")) for d in text.split(",")))


def _no_missing_rules(caplog: pytest.LogCaptureFixture) -> None:
    text = caplog.text
    assert "no sharding rule" not in text and "no cost rule" not in text, text
    assert "does not rebuild" not in text, text


def _ops(graph: autoshard.Graph, primitive: str) -> list[autoshard.Op]:
    return [op for op in graph.ops if op.primitive == primitive]


def _devices(reverse: bool = False) -> np.ndarray:
    devices = np.array(jax.devices()[:8])
    return (devices[::-1] if reverse else devices).reshape(2, 4)


# ---- shard_map -------------------------------------------------------------------------------------------


def _region_step(mesh: Mesh):
    """A loss and its gradients through a shard_map region fixed to (rows over x) @ (columns over y)."""

    def region(h: jax.Array, w: jax.Array) -> jax.Array:
        return jax.shard_map(lambda h, w: jnp.tanh(h @ w), mesh=mesh, in_specs=(P("x", None), P(None, "y")),
                             out_specs=P("x", "y"))(h, w)

    def step(w0: jax.Array, w: jax.Array, x: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        def loss(w0: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.mean(region(jnp.tanh(x @ w0), w) ** 2)

        return jax.value_and_grad(loss, argnums=(0, 1))(w0, w)

    keys = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(keys[0], (16, 32)), jax.random.normal(keys[1], (32, 64)),
            jax.random.normal(keys[2], (64, 16)))
    return step, args


def test_a_shard_map_region_is_planned_around_its_specs(caplog: pytest.LogCaptureFixture) -> None:
    unruled.forget()
    step, args = _region_step(Mesh(_devices(), ("x", "y")))
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        plan = autoshard.plan(step, *args, mesh=MESH, time_budget_s=2)
    _no_missing_rules(caplog)
    graph = autoshard.trace(step, *args)
    regions = _ops(graph, "shard_map")
    assert len(regions) == 2  # the forward region and its transpose in the backward pass
    forward = regions[0]
    # the result (its place among the residuals differs between jax releases) leaves in the out_specs' layout
    result = next(k for k, t in enumerate(forward.outputs) if graph.tensors[t].shape == (64, 64))
    assert plan.specs[()][forward.outputs[result]] == _spec("x,y")

    cost = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("x", "y"))
    (only,) = strategies_for(forward, RuleContext.of(graph, cost.mesh), cost)
    assert only.in_specs == (_spec("x,-"), _spec("-,y")) and only.out_specs[result] == _spec("x,y")
    # the edge into the region prices the resharding from its operand's layout to the in_specs'
    built = build_problem(graph, cost, None)
    node = next(i for i, n in enumerate(built.nodes) if n.kind == "op" and n.ops[0] == ((), forward.id))
    h_edge = next(k for k, e in enumerate(built.edges) if e.v == node and e.tensor == ((), forward.inputs[0]))
    producer = built.nodes[built.edges[h_edge].u]
    prices = built.problem.edge_costs[h_edge][:, 0]
    layouts = [producer.produced(((), forward.inputs[0]), s) for s in range(producer.k)]
    assert prices[layouts.index(_spec("x,-"))] == 0.0
    assert prices[layouts.index(_spec("-,-"))] == 0.0  # slicing a replicated value is free
    assert prices[layouts.index(_spec("y,-"))] > 0.0


@pytest.mark.parametrize("reverse", [False, True], ids=["same-devices", "devices-reordered"])
def test_a_shard_map_step_runs_like_jit(reverse: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The region runs as written, moved onto the device mesh (a user mesh over the same devices in another
    order would otherwise be refused by jax.jit: 'incompatible devices')."""
    unruled.forget()
    step, args = _region_step(Mesh(_devices(reverse), ("x", "y")))
    par = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=2)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        got = par(*args)
    _no_missing_rules(caplog)
    assert global_rel_error(jax.jit(step)(*args), got) <= TOL


def test_a_shard_map_on_another_mesh_is_refused_naming_both() -> None:
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def step(x: jax.Array) -> jax.Array:
        return jax.shard_map(lambda x: x * 2.0, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(x).sum()

    with pytest.raises(PlanningError) as e:
        autoshard.plan(step, jax.ShapeDtypeStruct((16, 4), jnp.float32), mesh=MESH, time_budget_s=1)
    msg = str(e.value)
    assert "test_custom_ops.py" in msg and "written for the mesh {'data': 8}" in msg
    assert "the plan's mesh is {'x': 2, 'y': 4}" in msg and "plan on mesh={'data': 8}" in msg


# ---- custom_partitioning -------------------------------------------------------------------------------


def _partitioned_matmul(seen: list[tuple[P, P]]):
    """``a @ b`` with Shardy's rule "i j, j k -> i k" (j a reduction factor): the partition callback keeps
    the layouts it is given and all-reduces a split contraction."""

    @custom_partitioning
    def matmul(a: jax.Array, b: jax.Array) -> jax.Array:
        return a @ b

    def partition(mesh, arg_shapes, result_shape):
        a, b = (tuple(s.sharding.spec) + (None,) * (2 - len(s.sharding.spec)) for s in arg_shapes)
        seen.append((P(*a), P(*b)))
        i, j = a
        k = b[1] if b[1] not in (i, j) else None

        def lower(x: jax.Array, y: jax.Array) -> jax.Array:
            out = x @ y
            return jax.lax.psum(out, j) if j is not None else out

        return mesh, lower, NamedSharding(mesh, P(i, k)), (NamedSharding(mesh, P(i, j)), NamedSharding(mesh, P(j, k)))

    matmul.def_partition(partition=partition, sharding_rule="i j, j k -> i k", reduction_factors=("j",))
    return matmul


def _matmul_step(matmul):
    def step(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
        return jnp.mean(matmul(jnp.tanh(matmul(x, w1)), w2) ** 2)

    keys = jax.random.split(jax.random.key(1), 3)
    return step, (jax.random.normal(keys[0], (64, 128)), jax.random.normal(keys[1], (128, 256)),
                  jax.random.normal(keys[2], (256, 64)))


def test_custom_partitioning_candidates_come_from_its_sharding_rule(caplog: pytest.LogCaptureFixture) -> None:
    unruled.forget()
    step, args = _matmul_step(_partitioned_matmul([]))
    graph = autoshard.trace(step, *args)
    cost = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("x", "y"))
    op = _ops(graph, "custom_partitioning")[0]
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        found = strategies_for(op, RuleContext.of(graph, cost.mesh), cost, set())
    _no_missing_rules(caplog)
    by_layout = {(*s.in_specs, *s.out_specs): s for s in found}
    rows = by_layout[(_spec("x,-"), _spec("-,-"), _spec("x,-"))]  # i split: no collective
    assert not rows.comm
    cols = by_layout[(_spec("-,-"), _spec("-,y"), _spec("-,y"))]  # k split
    assert not cols.comm
    summed = by_layout[(_spec("-,y"), _spec("y,-"), _spec("-,-"))]  # j split: the results are all-reduced
    assert [(c.kind, c.axes) for c in summed.comm] == [("all_reduce", ("y",))]
    # every candidate keeps the factors consistent: a's j is b's j, a's i is the result's i
    for s in found:
        a, b, c = s.in_specs[0].dims, s.in_specs[1].dims, s.out_specs[0].dims
        assert a[1] == b[0] and a[0] == c[0] and b[1] == c[1]
    assert rows.compute_time < by_layout[(_spec("-,-"), _spec("-,-"), _spec("-,-"))].compute_time


def test_a_custom_partitioning_step_runs_like_jit(caplog: pytest.LogCaptureFixture) -> None:
    """A tight memory budget makes the plan split the calls; the partition callback then sees the split
    layouts the plan pinned around them."""
    unruled.forget()
    seen: list[tuple[P, P]] = []
    step, args = _matmul_step(_partitioned_matmul(seen))
    par = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=2, memory_budget=160 * 1024)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        got = par(*args)
    _no_missing_rules(caplog)
    assert global_rel_error(jax.jit(step)(*args), got) <= TOL
    planned = [par.plan.specs[()][op.outputs[0]] for op in _ops(par.graph, "custom_partitioning")]
    assert any(not s.is_replicated() for s in planned), planned
    assert any(a != P(None, None) or b != P(None, None) for a, b in seen), seen


def test_custom_partitioning_without_a_rule_is_replicated_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    @custom_partitioning
    def double(a: jax.Array) -> jax.Array:
        return a * 2.0

    double.def_partition(partition=lambda mesh, shapes, result: (mesh, lambda a: a * 2.0, result.sharding,
                                                                  tuple(s.sharding for s in shapes)),
                         sharding_rule=lambda *_: "i -> i")
    unruled.forget()
    graph = autoshard.trace(lambda a: double(a), jax.ShapeDtypeStruct((16,), jnp.float32))
    cost = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("x", "y"))
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        (only,) = strategies_for(graph.ops[0], RuleContext.of(graph, cost.mesh), cost, set())
    assert only.in_specs[0].is_replicated() and only.out_specs[0].is_replicated()
    assert "custom_partitioning" in caplog.text and "sharding_rule is a callable" in caplog.text


# ---- custom kernels ----------------------------------------------------------------------------------------


def _scale_kernel(x_ref, o_ref):
    o_ref[...] = jnp.tanh(x_ref[...]) * 2.0


def _scaled(x: jax.Array, name: str | None = None) -> jax.Array:
    return pl.pallas_call(_scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=True,
                          name=name)(x)


def test_register_rule_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="does not use"):
        autoshard.register_rule("autoshard_test_kernel", "b s, b s -> b s", split=("h",))
    with pytest.raises(ValueError, match="no result dimension"):
        autoshard.register_rule("autoshard_test_kernel", "b k, k n -> b n", split=("k",))
    with pytest.raises(ValueError, match="built-in sharding rule"):
        autoshard.register_rule("dot_general", "i j, j k -> i k", split=("i",))
    with pytest.raises(ValueError, match="expected 'operands -> results'"):
        autoshard.register_rule("autoshard_test_kernel", "b s", split=("b",))
    assert "autoshard_test_kernel" not in custom.KERNELS


def test_a_registered_kernel_splits_only_along_its_split_factors(caplog: pytest.LogCaptureFixture) -> None:
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    cost = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("x", "y"))
    unruled.forget()
    graph = autoshard.trace(lambda x: _scaled(x, "autoshard_test_scale"), x)
    (op,) = _ops(graph, "pallas_call")
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        (unregistered,) = strategies_for(op, RuleContext.of(graph, cost.mesh), cost, set())
    assert unregistered.out_specs[0].is_replicated()
    assert "kernel 'autoshard_test_scale'" in caplog.text and "autoshard.register_rule(" in caplog.text

    autoshard.register_rule("autoshard_test_scale", "rows d -> rows d", split=("rows",),
                            flops=lambda ins, outs: 3.0 * math.prod(outs[0]))
    try:
        caplog.clear()
        graph = autoshard.trace(lambda x: _scaled(x, "autoshard_test_scale"), x)
        (op,) = _ops(graph, "pallas_call")
        assert op.flops == 3.0 * 16 * 64
        with caplog.at_level(logging.WARNING, logger="autoshard"):
            found = strategies_for(op, RuleContext.of(graph, cost.mesh), cost, set())
        _no_missing_rules(caplog)
        assert {str(s.out_specs[0]) for s in found} == {"R·R", "S(x)·R", "S(y)·R", "S(x,y)·R"}
        assert all(s.in_specs == s.out_specs for s in found)
    finally:
        custom.forget_rule("autoshard_test_scale")
    # the kernel function's name stands for a kernel given no name=
    assert autoshard.trace(_scaled, x).ops[0].primitive == "pallas_call"
    from autoshard.trace.costs import custom_call_name
    assert custom_call_name("pallas_call", autoshard.trace(_scaled, x).ops[0].eqn.params) == "_scale_kernel"


def test_a_kernel_rule_with_leading_batch_dimensions_or_the_wrong_rank(caplog: pytest.LogCaptureFixture) -> None:
    cost = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("x", "y"))
    graph = autoshard.trace(lambda x: _scaled(x, "autoshard_test_batched"), jax.ShapeDtypeStruct((4, 8, 16),
                                                                                                 jnp.float32))
    (op,) = _ops(graph, "pallas_call")
    ctx = RuleContext.of(graph, cost.mesh)
    autoshard.register_rule("autoshard_test_batched", "... d -> ... d", split=("...",))
    try:
        found = strategies_for(op, ctx, cost, set())
        assert not any(s.out_specs[0].dims[2] for s in found)  # d is not split
        assert {s.out_specs[0].dims[:2] for s in found} >= {(("x",), ("y",)), (("y",), ("x",)), ((), ("x", "y"))}
        unruled.forget()
        autoshard.register_rule("autoshard_test_batched", "b d -> b d", split=("b",))  # a rank-2 rule
        with caplog.at_level(logging.WARNING, logger="autoshard"):
            (only,) = strategies_for(op, ctx, cost, set())
        assert only.out_specs[0].is_replicated()
        assert "does not fit the op: operand 0 has shape [4, 8, 16]" in caplog.text
    finally:
        custom.forget_rule("autoshard_test_batched")


def test_the_flash_attention_example_plans_its_kernel_split_and_runs_like_jit(
        caplog: pytest.LogCaptureFixture) -> None:
    unruled.forget()
    ex = load_example(ROOT / "examples" / "flash_attention.py", "tiny", abstract=False)
    state, batch = ex.args
    par = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=2)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        s_par, m_par = par(state, batch)
    _no_missing_rules(caplog)
    s_ref, m_ref = jax.jit(ex.train_step)(state, batch)
    assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
    assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL
    (kernel,) = _ops(par.graph, "pallas_call")
    b, h, s, d = par.graph.tensors[kernel.inputs[0]].shape
    assert kernel.flops == 4.0 * b * h * s * s * d
    specs = [par.plan.specs[()][t] for t in (*kernel.inputs, *kernel.outputs)]
    assert all(not s.dims[2] and not s.dims[3] for s in specs), specs  # seq and head_dim stay whole
    assert any(s.dims[0] or s.dims[1] for s in specs), specs  # the kernel's work is split by batch or heads


# ---- reshard ---------------------------------------------------------------------------------------------------


def test_a_second_call_at_a_new_batch_size_plans_its_reshards(caplog: pytest.LogCaptureFixture) -> None:
    """The first call's results come back placed on the mesh; tracing with them, grad reshards its seed
    (a literal 1.0) onto that mesh. On Auto axes that reshard is a no-op the planner lays out freely."""

    def step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g, loss

    keys = jax.random.split(jax.random.key(2), 3)
    w = jax.random.normal(keys[0], (16, 16))
    x1, x2 = jax.random.normal(keys[1], (8, 16)), jax.random.normal(keys[2], (32, 16))
    unruled.forget()
    par = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=2)
    ref = jax.jit(step)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        w_par, l1 = par(w, x1)
        w_par, l2 = par(w_par, x2)
    _no_missing_rules(caplog)
    assert _ops(par.graph, "reshard"), "the second trace should hold the reshards this test is about"
    w_ref, r1 = ref(w, x1)
    w_ref, r2 = ref(w_ref, x2)
    assert global_rel_error((r1, r2, w_ref), (l1, l2, w_par)) <= TOL


@pytest.mark.parametrize(("x_type", "layouts"), [("Explicit", {"R·S(y)"}), ("Auto", {"R·S(y)", "S(x)·S(y)", "R·S(x,y)"})])
def test_reshard_on_explicit_axes_fixes_the_dimensions_it_names(x_type: str, layouts: set[str]) -> None:
    """An Explicit axis the sharding does not name replicates the value over it; an Auto axis is free."""
    types = (getattr(jax.sharding.AxisType, x_type), jax.sharding.AxisType.Explicit)
    explicit = jax.make_mesh((2, 4), ("x", "y"), axis_types=types)

    def f(a: jax.Array) -> jax.Array:
        return jax.sharding.reshard(a, P(None, "y")) * 2.0

    with jax.set_mesh(explicit):
        graph = autoshard.trace(f, jax.ShapeDtypeStruct((8, 16), jnp.float32))
    (op,) = _ops(graph, "reshard")
    cost = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("x", "y"))
    found = strategies_for(op, RuleContext.of(graph, cost.mesh), cost)
    assert {str(s.out_specs[0]) for s in found} == layouts
    assert all(s.in_specs == s.out_specs for s in found)
    other = CostModel.load("h100", mesh_shape=(8,), axis_names=("y",))
    with pytest.raises(PlanningError, match="Explicit mesh axes"):
        strategies_for(op, RuleContext.of(graph, other.mesh), other)


def test_a_step_on_explicit_axes_reshards_into_a_region_and_runs_like_jit(caplog: pytest.LogCaptureFixture) -> None:
    """Explicit sharding as jax writes it: reshard the operands to the region's layouts, then shard_map;
    the reshards fix those layouts, and the program runs on the (Auto) device mesh."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def f(a: jax.Array, w: jax.Array) -> jax.Array:
        a = jax.sharding.reshard(a, NamedSharding(mesh, P("x", "y")))
        w = jax.sharding.reshard(w, NamedSharding(mesh, P("y", None)))
        h = jax.shard_map(lambda a, w: jax.lax.psum(a @ w, "y"), mesh=mesh, in_specs=(P("x", "y"), P("y", None)),
                          out_specs=P("x"))(a, w)
        return jnp.sum(jnp.tanh(h) ** 2)

    step = jax.value_and_grad(f, argnums=(0, 1))
    args = (jax.random.normal(jax.random.key(3), (16, 32)), jax.random.normal(jax.random.key(4), (32, 8)))
    unruled.forget()
    par = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=2)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        got = par(*args)
    _no_missing_rules(caplog)
    assert global_rel_error(jax.jit(step)(*args), got) <= TOL
    fixed = [par.plan.specs[()][op.outputs[0]] for op in _ops(par.graph, "reshard")
             if par.graph.tensors[op.outputs[0]].shape == (16, 32)]
    assert fixed and all(s == _spec("x,y") for s in fixed), fixed
