"""Tracing a step into a Graph: structure, roles, flops, control flow, invariants, and errors."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import networkx as nx
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_example, load_module
from autoshard.trace import GraphError, Role, TraceError, unruled

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_"))


def _all_primitives(graph: autoshard.Graph) -> set[str]:
    return {op.primitive for _, op in graph.walk()}


def _cost_analysis_flops(fn, *args) -> float:
    ca = jax.jit(fn).lower(*args).compile().cost_analysis()
    if isinstance(ca, list | tuple):
        ca = ca[0]
    return float(ca["flops"])


# ---- the examples -----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_traces_and_verifies(path: Path) -> None:
    ex = load_example(path, "tiny", abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    graph.verify()

    params = graph.input_tensors(Role.PARAM)
    opt = graph.input_tensors(Role.OPT_STATE)
    batch = graph.input_tensors(Role.BATCH)
    assert params and opt and batch, "roles were not inferred from the TrainState / batch pytrees"
    n_params = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(ex.args[0].params))
    assert sum(t.size for t in params) == n_params
    assert all(t.name.startswith("state.params.") for t in params)
    assert all(t.name.startswith("batch") for t in batch)

    # Every parameter and optimizer-state leaf comes back as the new value of itself.
    aliased = {graph.inputs[i] for i in graph.output_aliases.values()}
    assert {t.id for t in params + opt} <= aliased
    assert any(op.primitive in ("dot_general", "conv_general_dilated") for _, op in graph.walk())
    # Source lines point at the model file, not into flax or optax.
    dots = [op for _, op in graph.walk() if op.primitive in ("dot_general", "conv_general_dilated")]
    assert any(path.name in op.source for op in dots), [op.source for op in dots[:3]]
    assert graph.summary()


def test_gpt_scan_variant_is_one_op_per_stack_with_a_body() -> None:
    gpt = ROOT / "examples" / "gpt.py"
    unrolled = load_example(gpt, "tiny", ["layers=3"], abstract=True)
    scanned = load_example(gpt, "tiny", ["layers=3", "scan_layers=true"], abstract=True)
    g_u = autoshard.trace(unrolled.train_step, *unrolled.args)
    g_s = autoshard.trace(scanned.train_step, *scanned.args)
    g_s.verify()
    scans = [op for op in g_s.ops if op.primitive == "scan"]
    assert {op.trip_count for op in scans} == {3}
    assert {op.phase for op in scans} >= {"forward", "backward"}
    fwd = next(op for op in scans if op.phase == "forward")
    assert sum(op.primitive == "dot_general" for op in fwd.bodies[0].ops) >= 4
    assert len(g_s.ops) < len(g_u.ops) / 2
    # Stacked parameters carry the layer axis; the stack's flops equal the unrolled model's.
    stacked = [t for t in g_s.input_tensors(Role.PARAM) if ".blocks." in t.name]
    assert stacked and all(t.shape[0] == 3 for t in stacked)
    assert g_s.total_flops == pytest.approx(g_u.total_flops, rel=0.01)
    # Unrolled blocks carry their layer tag.
    layers = {op.layer.split("/")[-1] for op in g_u.ops if op.primitive == "dot_general" and op.layer}
    assert {"block_0", "block_1", "block_2"} <= layers


def _gpt_forward(preset_overrides: list[str]):
    gpt = load_module(ROOT / "examples" / "gpt.py")
    ex = load_example(ROOT / "examples" / "gpt.py", "125m", preset_overrides, abstract=True)
    state = ex.args[0]
    tokens = jax.ShapeDtypeStruct((ex.config.batch, ex.config.seq_len), jnp.int32)

    def forward(params, tokens):
        return state.apply_fn({"params": params}, tokens)

    return gpt, ex.config, forward, state.params, tokens


def test_gpt_forward_flops_match_the_analytic_count() -> None:
    gpt, config, forward, params, tokens = _gpt_forward(["batch=2"])
    graph = autoshard.trace(forward, params, tokens)
    graph.verify()
    analytic = gpt.forward_flops(config)
    dots = sum(op.flops for op in graph.ops if op.primitive == "dot_general")
    assert dots == pytest.approx(analytic, rel=1e-9)  # the matmuls are counted exactly
    assert graph.total_flops == pytest.approx(analytic, rel=0.05)


def test_gpt_forward_flops_match_xla_cost_analysis() -> None:
    _, _, forward, params, tokens = _gpt_forward(["batch=1", "layers=2", "seq_len=256"])
    graph = autoshard.trace(forward, params, tokens)
    xla = _cost_analysis_flops(forward, params, tokens)
    assert graph.total_flops == pytest.approx(xla, rel=0.05)


def test_conv_flops_match_xla() -> None:
    x = jax.ShapeDtypeStruct((2, 16, 16, 8), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 8, 12), jnp.float32)

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    graph = autoshard.trace(conv, x, w)
    (op,) = graph.ops
    # SAME padding: per spatial dimension, 16 outputs x 3 taps less the 2 taps that fall on padding.
    assert op.flops == 2 * (2 * 12) * 8 * (16 * 3 - 2) ** 2
    assert op.flops == pytest.approx(_cost_analysis_flops(conv, x, w), rel=1e-6)

    def strided_grouped(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (2, 2), ((1, 2), (0, 1)), rhs_dilation=(2, 1), feature_group_count=2,
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )

    w2 = jax.ShapeDtypeStruct((3, 3, 4, 12), jnp.float32)
    (op,) = autoshard.trace(strided_grouped, x, w2).ops
    assert op.flops == pytest.approx(_cost_analysis_flops(strided_grouped, x, w2), rel=1e-6)


def test_dot_general_flops_and_bytes_are_exact() -> None:
    def f(a, b):
        return jnp.einsum("bij,bjk->bik", a, b)

    a = jax.ShapeDtypeStruct((3, 4, 5), jnp.float32)
    b = jax.ShapeDtypeStruct((3, 5, 6), jnp.bfloat16)
    graph = autoshard.trace(f, a, b.update(dtype=jnp.float32))
    dot = next(op for op in graph.ops if op.primitive == "dot_general")
    assert dot.flops == 2 * 3 * 4 * 6 * 5
    assert dot.bytes_in == (3 * 4 * 5 + 3 * 5 * 6) * 4
    assert dot.bytes_out == 3 * 4 * 6 * 4


# ---- control flow -----------------------------------------------------------------------------------


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))


def _control_flow_loss(w, x):
    @jax.jit
    def inner(a):
        return jnp.tanh(a @ w)

    @jax.checkpoint
    def block(a):
        return jax.nn.gelu(a @ w) * 2

    def body(c, _):
        return jnp.sin(c) @ w, None

    y, _ = jax.lax.scan(body, inner(x), None, length=3)
    y = jax.lax.cond(y.sum() > 0, lambda a: a + 1, lambda a: (a - 1) @ w, y)
    y = jax.nn.relu(block(_sin(y)))
    return jax.nn.logsumexp(y)


def test_control_flow_becomes_ops_with_bodies() -> None:
    def step(w, x):
        loss, g = jax.value_and_grad(_control_flow_loss)(w, x)
        # A counter loop outside the differentiated part (reverse mode cannot go through while).
        g = jax.lax.while_loop(lambda s: s[0] < 5, lambda s: (s[0] + 1, s[1] * 0.5), (0, g))[1]
        return w - 0.1 * g, loss

    graph = autoshard.trace(step, jnp.ones((4, 4)), jax.ShapeDtypeStruct((2, 4), jnp.float32))
    graph.verify()
    prims = _all_primitives(graph)
    # Calls are inlined; control flow stays as one op with nested bodies.
    assert not prims & {"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "closed_call"}
    assert {"scan", "cond", "while"} <= prims
    assert prims & {"checkpoint", "remat2"}

    scans = [op for op in graph.ops if op.primitive == "scan"]
    assert sorted(op.trip_count for op in scans) == [3, 3]
    fwd_scan = next(op for op in scans if op.phase == "forward")
    assert fwd_scan.flops == pytest.approx(3 * fwd_scan.bodies[0].total_flops)
    assert fwd_scan.flops >= 3 * 2 * 2 * 4 * 4

    whiles = [op for op in graph.ops if op.primitive == "while"]
    assert whiles and whiles[0].trip_count == 5 and len(whiles[0].bodies) == 2
    conds = [op for op in graph.ops if op.primitive == "cond"]
    assert all(len(op.bodies) == 2 for op in conds)
    for op in conds:
        assert op.flops == max(b.total_flops for b in op.bodies)
    remat = next(op for op in graph.ops if op.primitive in ("checkpoint", "remat2"))
    assert any(o.primitive == "dot_general" for o in remat.bodies[0].ops)
    # Body inputs inherit the role of what the op passes in: w, differentiated and returned anew, is a parameter.
    body_roles = {t.role for t in fwd_scan.bodies[0].input_tensors()}
    assert Role.PARAM in body_roles


def test_while_with_unknown_trip_count() -> None:
    def f(x, n):
        return jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] @ s[1]), (0, x))[1]

    graph = autoshard.trace(f, jnp.ones((4, 4)), 3)
    (loop,) = [op for op in graph.ops if op.primitive == "while"]
    assert loop.trip_count is None
    assert loop.flops == pytest.approx(loop.bodies[0].total_flops + loop.bodies[1].total_flops)


# ---- graph invariants and views ---------------------------------------------------------------------


def _small_step_graph() -> autoshard.Graph:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=True)
    return autoshard.trace(ex.train_step, *ex.args)


def test_live_intervals_schedule_and_networkx() -> None:
    graph = _small_step_graph()
    n = len(graph.ops)
    for tid in graph.inputs:
        assert graph.tensors[tid].live[0] == 0
    for tid in graph.outputs:
        assert graph.tensors[tid].live[1] == n
    for t in graph.tensors:
        if t.producer is not None:
            assert t.live[0] == t.producer
        if t.consumers:
            assert t.live[1] == max(max(t.consumers) + 1, t.live[1])
    g = graph.to_networkx()
    assert nx.is_directed_acyclic_graph(g)
    assert sum(1 for _, d in g.nodes(data=True) if d["kind"] == "op") == n
    assert graph.peak_live_bytes() >= sum(t.nbytes for t in graph.input_tensors(Role.PARAM))


@pytest.mark.parametrize("corruption", ["producer", "consumers", "live", "shape", "order"])
def test_verify_catches_broken_graphs(corruption: str) -> None:
    graph = _small_step_graph()
    dot = next(op for op in graph.ops if op.primitive == "dot_general")
    out = graph.tensors[dot.outputs[0]]
    tensors = list(graph.tensors)
    ops = list(graph.ops)
    if corruption == "producer":
        tensors[out.id] = dataclasses.replace(out, producer=dot.id + 1)
    elif corruption == "consumers":
        tensors[out.id] = dataclasses.replace(out, consumers=())
    elif corruption == "live":
        tensors[out.id] = dataclasses.replace(out, live=(out.live[0], out.live[0]))
    elif corruption == "shape":
        tensors[out.id] = dataclasses.replace(out, shape=(*out.shape, 2))
    else:
        first_consumer = out.consumers[0]
        ops[first_consumer], ops[dot.id] = (
            dataclasses.replace(ops[dot.id], id=first_consumer),
            dataclasses.replace(ops[first_consumer], id=dot.id),
        )
    broken = dataclasses.replace(graph, ops=tuple(ops), tensors=tuple(tensors))
    with pytest.raises(GraphError):
        broken.verify()


def test_roles_can_be_overridden_by_path_prefix() -> None:
    def step(state, batch):
        return {"w": state["w"] - batch.sum(), "ema": state["ema"] * 0.9}, batch.mean()

    state = {"w": jnp.ones((3,)), "ema": jnp.ones((3,))}
    graph = autoshard.trace(step, state, jnp.ones((3,)))
    assert {t.name: t.role for t in graph.input_tensors()} == {
        "state.ema": Role.STATE,
        "state.w": Role.STATE,
        "batch": Role.BATCH,
    }
    graph = autoshard.trace(step, state, jnp.ones((3,)), roles={"state.w": "param", "state.ema": Role.OPT_STATE})
    assert graph.tensor("state.w").role is Role.PARAM
    assert graph.tensor("state.ema").role is Role.OPT_STATE
    assert graph.output_aliases == {0: 0, 1: 1}
    with pytest.raises(TraceError, match=r"not a role.*param"):
        autoshard.trace(step, state, jnp.ones((3,)), roles={"state.w": "weights"})
    with pytest.raises(TraceError, match="matches no argument leaf"):
        autoshard.trace(step, state, jnp.ones((3,)), roles={"state.bias": "param"})


# ---- bad input --------------------------------------------------------------------------------------


def test_not_a_function() -> None:
    with pytest.raises(TraceError, match="expects a function"):
        autoshard.trace(42, jnp.ones(3))


def test_non_jax_function_gets_a_clear_error() -> None:
    def uses_numpy(x):
        return np.asarray(x).sum()

    with pytest.raises(TraceError, match=r"uses_numpy is not traceable.*jax\.numpy"):
        autoshard.trace(uses_numpy, jnp.ones(3))

    def branches_on_values(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(TraceError, match=r"lax\.cond"):
        autoshard.trace(branches_on_values, jnp.ones(3))


def test_mismatched_example_arguments() -> None:
    def step(w, x):
        return x @ w

    with pytest.raises(TraceError, match=r"cannot take the 1 example argument"):
        autoshard.trace(step, jnp.ones((3, 3)))
    with pytest.raises(TraceError, match=r"tracing step with the example arguments failed(.|\n)*w: float32\[3, 3\]"):
        autoshard.trace(step, jnp.ones((3, 3)), jnp.ones((2, 4)))
    with pytest.raises(TraceError, match=r"example argument x\.name is a str"):
        autoshard.trace(step, jnp.ones((3, 3)), {"name": "tokens"})


def test_unknown_primitive_is_logged_and_counted_as_zero(caplog: pytest.LogCaptureFixture) -> None:
    unruled.forget("autoshard_test_mystery")
    prim = jax.extend.core.Primitive("autoshard_test_mystery")
    prim.def_abstract_eval(lambda x: x)

    def f(x):
        return prim.bind(prim.bind(x * 2.0)) + 1.0

    with caplog.at_level(logging.WARNING, logger="autoshard"):
        graph = autoshard.trace(f, jax.ShapeDtypeStruct((4,), jnp.float32))
        autoshard.trace(f, jax.ShapeDtypeStruct((4,), jnp.float32))  # a second trace stays silent
    graph.verify()
    mystery = [op for op in graph.ops if op.primitive == "autoshard_test_mystery"]
    assert len(mystery) == 2 and all(op.flops == 0 for op in mystery)
    warnings = [r for r in caplog.records if "autoshard_test_mystery" in r.getMessage()]
    assert len(warnings) == 1, "warn once per primitive"
    assert "test_trace.py" in warnings[0].getMessage()


def _library_sin(x: jax.Array) -> jax.Array:
    return jnp.sin(x) * 2.0


def test_ops_inside_a_library_call_report_the_call_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op whose own frames are all library code (jax 0.11 keeps only the frames below a jitted
    function: optax's tree_bias_correction) reports the line that called the library."""
    from autoshard.trace import tracer

    monkeypatch.setattr(tracer, "_LIBRARY_MARKERS", ("test_trace.py",))  # this file plays the library

    def step(x: jax.Array) -> jax.Array:
        return jax.jit(_library_sin)(x)

    graph = autoshard.trace(step, jax.ShapeDtypeStruct((4,), jnp.float32))
    (sin,) = [op for op in graph.ops if op.primitive == "sin"]
    call_line = step.__code__.co_firstlineno + 1
    assert sin.source.endswith(f"test_trace.py:{call_line} (test_ops_inside_a_library_call_report_the_call_site"
                               ".<locals>.step)"), sin.source


def test_an_elementwise_result_takes_the_buffer_of_an_operand_that_dies_there() -> None:
    """XLA's buffer sharing: ``b = a * 2`` (read by a matmul, so materialised) is written over ``a`` when no
    one reads ``a`` afterwards; when something does, ``b`` gets a buffer of its own."""
    from autoshard.trace.buffers import buffers

    x = jnp.ones((64, 64), jnp.float32)
    graph = autoshard.trace(lambda x, w: ((x @ w) * 2.0) @ w, x, x)
    buf = buffers(graph)
    mul = next(op for op in graph.ops if op.primitive == "mul")
    a, b = mul.inputs[0], mul.outputs[0]
    assert graph.ops[graph.tensors[a].producer].primitive == "dot_general"
    assert not buf.held[a] and buf.held[b] and buf.live[b][0] == graph.tensors[a].producer

    def read_again(x, w):
        a = x @ w
        return ((a * 2.0) @ w) @ w + a

    graph = autoshard.trace(read_again, x, x)
    buf = buffers(graph)
    mul = next(op for op in graph.ops if op.primitive == "mul")
    a, b = mul.inputs[0], mul.outputs[0]
    assert buf.held[a] and buf.held[b] and buf.live[b][0] == mul.id


def test_a_buffer_taken_over_twice_is_live_from_its_first_value() -> None:
    """zeros -> scatter-add into them (in place) -> an add over that (in place again): one buffer, live from
    the zeros' producer on, so the chain leaves no gap in the charged memory."""
    from autoshard.trace.buffers import buffers

    x = jnp.ones((64, 64), jnp.float32)
    idx = jnp.arange(8)

    def f(x, w, idx):
        z = jnp.zeros((64, 64)).at[idx].add((x @ w)[:8])
        return (z + x) @ w

    graph = autoshard.trace(f, x, x, idx)
    buf = buffers(graph)
    scatter = next(op for op in graph.ops if op.primitive.startswith("scatter"))
    add = next(op for op in graph.ops if op.primitive == "add" and scatter.outputs[0] in op.inputs)
    zeros = graph.tensors[scatter.inputs[0]]
    assert not buf.held[zeros.id] and not buf.held[scatter.outputs[0]] and buf.held[add.outputs[0]]
    assert buf.live[add.outputs[0]][0] == zeros.producer
