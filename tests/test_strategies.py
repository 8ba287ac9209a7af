"""Sharding rules per primitive, and the solver problem built from a graph.

The golden cases solve the problem built from the examples and check the layouts chosen for the
parameters and the batch: data parallel for a small model on a big batch, Megatron column-then-row for a
very wide MLP on a small batch.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.planner.build import build_problem
from autoshard.strategies import FALLBACK, RULES, RuleContext, strategies_for
from autoshard.strategies.layout import reshape_groups
from autoshard.strategies.registry import enumerate_specs
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace import unruled
from autoshard.trace.costs import FLOP_RULES
from autoshard.trace.graph import Role
from cost_models import CostModel, ShardingSpec
from solvers import solve_intra_op

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


def _cost(shape=(2, 4), names=("data", "model")) -> CostModel:
    return CostModel.load("h100", mesh_shape=shape, axis_names=names)


def _strategies(fn, *args, cost=None):
    graph = autoshard.trace(fn, *args)
    cost = cost or _cost()
    ctx = RuleContext(graph, cost.mesh)
    return graph, [(op, strategies_for(op, ctx, cost)) for op in graph.ops]


def test_dot_general_offers_data_column_row_and_partial_layouts() -> None:
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    _, [(_, strategies)] = _strategies(lambda x, w: x @ w, x, w)
    found = {(str(s.in_specs[0]), str(s.in_specs[1]), str(s.out_specs[0])) for s in strategies}
    assert ("S(data)·R", "R·R", "S(data)·R") in found  # data parallel
    assert ("R·R", "R·S(model)", "R·S(model)") in found  # column parallel
    assert ("R·S(model)", "S(model)·R", "R·R +P(model)") in found  # row parallel: a pending sum
    assert ("S(data)·S(model)", "S(model)·R", "S(data)·R +P(model)") in found
    # Work splits over every axis the strategy uses.
    full = next(s for s in strategies if s.in_specs[0].is_replicated() and s.in_specs[1].is_replicated())
    split = next(s for s in strategies if str(s.out_specs[0]) == "S(data)·S(model)")
    assert split.compute_time < full.compute_time


def test_a_barrier_over_values_of_several_shapes_shards_them_alike() -> None:
    # trace.remat holds a block's stash with an anchor behind one optimization_barrier: [b, s, h] and
    # [b, s, 4h] values; each may be split on the batch or the hidden dimension, not only replicated
    a = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)
    b = jax.ShapeDtypeStruct((8, 16, 128), jnp.float32)
    _, ops = _strategies(lambda a, b: jax.lax.optimization_barrier((a, b)), a, b)
    [strategies] = [st for op, st in ops if op.primitive == "optimization_barrier"]
    found = {tuple(str(x) for x in s.out_specs) for s in strategies}
    assert ("S(data)·R·R", "S(data)·R·R") in found
    assert ("R·R·S(model)", "R·R·S(model)") in found
    assert ("R·R·R", "R·R·R") in found
    assert all(s.in_specs == s.out_specs for s in strategies)  # an identity on each operand


def test_dot_with_several_consumers_reduces_inside() -> None:
    def f(x, w):
        y = x @ w
        return jnp.sin(y) + jnp.cos(y)

    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    _, ops = _strategies(f, x, w)
    dot = next(s for op, s in ops if op.primitive == "dot_general")
    row = [s for s in dot if str(s.in_specs[1]) == "S(model)·R"]
    # the sum is reduced once, inside the op, not on each consumer's edge: all-reduced, or reduce-scattered
    # into a split of an output dimension (the ZeRO-2 gradient)
    assert row and all(not s.out_specs[0].partial and len(s.comm) == 1 for s in row)
    kinds = {(c.kind, c.axes) for s in row for c in s.comm}
    assert kinds == {("all_reduce", ("model",)), ("reduce_scatter", ("model",))}
    scattered = {str(s.out_specs[0]) for s in row if s.comm[0].kind == "reduce_scatter"}
    assert {"S(model)·R", "R·S(model)"} <= scattered


def test_reductions_and_layout_rules() -> None:
    def f(x):
        a = jnp.sum(x, axis=1)
        b = jnp.max(x, axis=1)
        c = x.reshape(8, 4, 16).transpose(1, 0, 2)
        return a, b, c

    _, ops = _strategies(f, jax.ShapeDtypeStruct((8, 64), jnp.float32))
    by = {op.primitive: s for op, s in ops}
    sums = {(str(s.in_specs[0]), str(s.out_specs[0])) for s in by["reduce_sum"]}
    assert ("R·S(model)", "R +P(model)") in sums
    maxes = [s for s in by["reduce_max"] if str(s.in_specs[0]) == "R·S(model)"]
    assert maxes and maxes[0].comm and not maxes[0].out_specs[0].partial
    reshapes = {(str(s.in_specs[0]), str(s.out_specs[0])) for s in by["reshape"]}
    assert ("S(data)·R", "S(data)·R·R") in reshapes
    assert ("R·S(model)", "R·S(model)·R") in reshapes  # 64 -> (4, 16): the major piece takes the split
    transposes = {(str(s.in_specs[0]), str(s.out_specs[0])) for s in by["transpose"]}
    assert ("S(data)·S(model)·R", "S(model)·S(data)·R") in transposes


def test_reshape_groups() -> None:
    assert reshape_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert reshape_groups((8, 1, 16), (8, 16)) == [([0], [0]), ([2], [1])]
    assert reshape_groups((4, 6), (2, 12)) == [([0, 1], [0, 1])]


def test_embedding_gather_and_its_gradient() -> None:
    table = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)

    def f(table, tokens):
        return jnp.take(table, tokens, axis=0).sum()

    def grad(table, tokens):
        return jax.grad(f)(table, tokens)

    _, ops = _strategies(grad, table, tokens)
    gather = next(s for op, s in ops if op.primitive == "gather")
    outs = {str(s.out_specs[0]) for s in gather}
    assert "S(data)·R·S(model)" in outs  # tokens split by batch, table by hidden
    scatter = next(s for op, s in ops if op.primitive in ("scatter-add", "scatter_add"))
    dp = [s for s in scatter if str(s.in_specs[2]).startswith("S(data)")]
    assert dp and all("data" in s.out_specs[0].partial for s in dp)  # per-device partial table gradient


# Every example's tiny preset, and the GPT variants that change the primitives met (scan, remat).
VARIANTS = [(p, []) for p in EXAMPLES] + [
    (ROOT / "examples" / "gpt.py", ov) for ov in (["scan_layers=true"], ["remat=true"],
                                                   ["scan_layers=true", "remat=true"], ["dtype=bfloat16"])
]


def test_every_primitive_in_the_examples_has_a_rule_or_a_deliberate_fallback() -> None:
    """Under the installed jax: a new jax release that brings a new primitive (jax 0.11's
    ``one_minus_square`` in tanh's derivative) fails here until it gets a rule or joins FALLBACK."""
    seen: dict[str, str] = {}
    for path, overrides in VARIANTS:
        ex = load_example(path, "tiny", overrides, abstract=True)
        graph = autoshard.trace(ex.train_step, *ex.args)
        for _, op in graph.walk():
            seen.setdefault(op.primitive, f"{path.name} {overrides}: {op.source}")
    assert {"scan", "remat2", "dot_general"} <= set(seen) or {"scan", "checkpoint"} <= set(seen)
    no_sharding = sorted(p for p in seen if p not in RULES and p not in FALLBACK and p not in jc.CONTROL_FLOW)
    assert not no_sharding, "neither a sharding rule nor a deliberate fallback: " + "; ".join(
        f"{p} ({seen[p]})" for p in no_sharding)
    no_cost = sorted(p for p in seen if p not in FLOP_RULES and p not in jc.CONTROL_FLOW)
    assert not no_cost, "no flop rule: " + "; ".join(f"{p} ({seen[p]})" for p in no_cost)
    assert not FALLBACK & set(RULES), "a primitive with a rule is not a fallback"


def test_unknown_primitive_is_replicated_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """One warning per primitive per process, from whichever pass meets it first (here the tracer: no flop
    rule), however many graphs and problems it appears in."""
    unruled.forget("autoshard_test_opaque")
    prim = jax.extend.core.Primitive("autoshard_test_opaque")
    prim.def_abstract_eval(lambda x: x)
    cost = _cost()
    with caplog.at_level("WARNING", logger="autoshard"):
        for _ in range(2):
            graph = autoshard.trace(lambda x: prim.bind(x * 2.0), jax.ShapeDtypeStruct((8, 8), jnp.float32))
            op = next(op for op in graph.ops if op.primitive == "autoshard_test_opaque")
            warned: set[str] = set()
            (only,) = strategies_for(op, RuleContext(graph, cost.mesh), cost, warned)
            assert warned == {"autoshard_test_opaque"}
    assert only.in_specs[0].is_replicated() and only.out_specs[0].is_replicated()
    msgs = [r.getMessage() for r in caplog.records if "autoshard_test_opaque" in r.getMessage()]
    assert len(msgs) == 1 and "replicated" in msgs[0], msgs


def test_sharding_warning_when_only_the_sharding_rule_is_missing(caplog: pytest.LogCaptureFixture) -> None:
    unruled.forget("sin")
    graph, _ = _strategies(jnp.sin, jax.ShapeDtypeStruct((8, 8), jnp.float32))
    (op,) = graph.ops
    cost = _cost()
    saved = RULES.pop("sin")
    try:
        with caplog.at_level("WARNING", logger="autoshard"):
            for _ in range(3):
                strategies_for(op, RuleContext(graph, cost.mesh), cost, set())
    finally:
        RULES["sin"] = saved
        unruled.forget("sin")
    msgs = [r.getMessage() for r in caplog.records if "'sin'" in r.getMessage()]
    assert len(msgs) == 1 and "no sharding rule for primitive 'sin'" in msgs[0]


def test_deliberate_fallbacks_are_replicated_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    def f(key: jax.Array) -> jax.Array:
        return jax.random.normal(jax.random.fold_in(key, 3), (8, 8))

    graph, ops = _strategies(f, jax.random.key(0))
    cost = _cost()
    fallen: set[str] = set()
    with caplog.at_level("WARNING", logger="autoshard"):
        for op, _ in ops:
            strategies_for(op, RuleContext(graph, cost.mesh), cost, fallen)
    assert fallen and fallen <= FALLBACK
    assert not [r for r in caplog.records if "no sharding rule" in r.getMessage()]


# ---- the problem built from a graph, solved -----------------------------------------------------------


def _solve(path: str, preset: str, shape, names):
    ex = load_example(ROOT / "examples" / path, preset, abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    built = build_problem(graph, _cost(shape, names), None)
    built.problem.verify()
    sol = solve_intra_op(built.problem, time_budget_s=60)
    chosen = {}
    for i, node in enumerate(built.nodes):
        if node.kind == "input":
            (key, spec), = node.produces[sol.choice[i]]
            chosen[graph.tensors[key[1]].name] = spec
    return graph, built, sol, chosen


def test_golden_data_parallel_for_a_small_model_on_a_big_batch() -> None:
    graph, built, sol, chosen = _solve("mlp.py", "big-batch", (8,), ("data",))
    for t in graph.input_tensors(Role.PARAM):
        assert chosen[t.name].is_replicated(), (t.name, chosen[t.name])
    for t in graph.input_tensors(Role.BATCH):
        assert chosen[t.name].dims[0] == ("data",), (t.name, chosen[t.name])
    # Every forward matmul splits the batch; the backward weight-gradient matmuls leave a pending sum
    # over the data axis (the gradient all-reduce).
    dots = [(node, node.strategies[sol.choice[i]]) for i, node in enumerate(built.nodes)
            if node.kind == "op" and node.name.startswith("dot_general")]
    forward = [(n, s) for n, s in dots if graph.ops[n.ops[0][1]].phase == "forward"]
    assert len(forward) == 4
    assert all(s.in_specs[0].dims[0] == ("data",) for _, s in forward)
    assert sum("data" in s.out_specs[0].partial for _, s in dots) == 4


def test_golden_megatron_column_then_row_for_a_wide_mlp() -> None:
    graph, _, _, chosen = _solve("mlp.py", "wide", (8,), ("model",))
    kernels = sorted(t.name for t in graph.input_tensors(Role.PARAM) if t.name.endswith("kernel"))
    first, second = kernels
    assert chosen[first].dims == ((), ("model",)), chosen[first]  # column parallel
    assert chosen[second].dims == (("model",), ()), chosen[second]  # row parallel
    # Adam's moments live with their parameter.
    for t in graph.input_tensors(Role.OPT_STATE):
        if t.name.endswith(first.split("state.params.")[1]) and t.shape == graph.tensor(first).shape:
            assert chosen[t.name] == chosen[first]


def test_memory_costs_and_intervals_are_consistent() -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    cost = _cost((8,), ("data",))
    built = build_problem(graph, cost, 1e9)
    p = built.problem
    p.verify()
    assert p.memory_limit == 1e9
    for node, mem in zip(built.nodes, p.node_memory, strict=True):
        assert np.all(mem >= 0)
        if node.kind == "input":
            (key, _), = node.produces[0]
            t = graph.tensors[key[1]]
            full = [k for k, s in enumerate(node.produces) if s[0][1].is_replicated()]
            assert mem[full[0]] == t.nbytes
            assert node.interval[0] == 0
    # A parameter's optimizer update reads it: the tie from new to old parameter exists.
    assert any(e.kind == "state" for e in built.edges)
    assert ShardingSpec.parse("S(data)·R").dims == (("data",), ())


def test_reshard_matrices_are_the_pairwise_prices() -> None:
    """The problem builder's edge matrices (priced once per pair of layouts, kept in a table by layout
    number that grows as layouts are first seen) equal pricing every pair on its own: repeated layouts,
    layouts of another rank and missing ones (None: no layout works, +inf), over more layouts than the
    table starts with, asked in two calls that share some."""
    from autoshard.planner.build import _Build

    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    cost = _cost()
    b = _Build(graph, cost)
    shape, other = (8, 16, 32), (8, 16)
    specs = enumerate_specs(shape, RuleContext(graph, cost.mesh))
    partial = [ShardingSpec(dims=s.dims, partial=frozenset({"model"})) for s in specs if "model" not in s.axes_used]
    assert len(specs) + len(partial) > 16
    wrong_rank = ShardingSpec.replicated(len(other))
    src = [*specs, *partial, specs[3], wrong_rank]
    first = [specs[0], None, *partial, specs[-1], specs[-1], wrong_rank]
    second = [*reversed(specs), specs[1]]
    for dst, combine in ((first, 1), (second, 1), (second, 4)):
        got = b.reshard_matrix(shape, "float32", src, dst, combine)
        want = np.array([[math.inf if bb is None or len(aa.dims) != 3 or len(bb.dims) != 3 else
                          0.0 if aa == bb else cost.reshard_time(shape, "float32", aa, bb, combine=combine)
                          for bb in dst] for aa in src])
        np.testing.assert_array_equal(got, want)
        assert np.isfinite(got[:len(specs) + len(partial), 2:len(partial) + 2]).all()


def test_a_split_and_a_concatenate_fuse_as_the_slices_they_are() -> None:
    """``jnp.split`` lowers to slices and XLA fuses a concatenate into a loop kernel: a rotary embedding's
    rotation written with ``jnp.split`` and ``jnp.concatenate`` costs one pass over its input, as slices
    do (llama-7b's RoPE moved 164 ms of bytes each way a step when their results counted as materialised;
    its bf16 flash plan went from 44.9% to 50.0% MFU)."""
    from autoshard.planner.build import seconds_by_op
    from autoshard.strategies.registry import fused_tensors

    x = jax.ShapeDtypeStruct((8, 512, 1024), jnp.float32)

    def rotate(x):
        a, b = jnp.split(x, 2, axis=-1)
        return jnp.sum(jnp.concatenate([-b, a], axis=-1) * 0.5 + x)

    def plain(x):  # the same pass over x, without the rotation
        return jnp.sum(x * 0.5 + x)

    cost = _cost((1,), ("x",))
    seconds = {}
    for fn in (rotate, plain):
        graph = autoshard.trace(fn, x)
        if fn is rotate:
            made = [t for op in graph.ops if op.primitive in ("split", "concatenate") for t in op.outputs]
            assert len(made) == 3 and set(made) <= fused_tensors(graph)
        built = build_problem(graph, cost, None)
        seconds[fn.__name__] = sum(seconds_by_op(built, np.zeros(len(built.nodes), dtype=np.int64)).values())
    # materialised, the halves and the rotation were written and read again: 3.5x the plain pass
    assert seconds["rotate"] <= 1.05 * seconds["plain"], seconds
