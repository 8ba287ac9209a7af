"""``autoshard.trace.jaxpr_compat``: equation params read the same way in jax 0.10's and 0.11's layouts.

Most tests here do not depend on the installed jax: they take a real equation and rewrite its params into
the *other* release's layout (a scan's ``num_consts``/``num_carry`` of 0.10 against the ``ft_in``/``ft_out``
flat trees of 0.11), then check that the accessors, the tracer's Graph and the planner's problem agree.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard.emit import emit
from autoshard.errors import TraceError
from autoshard.planner.build import build_problem
from autoshard.trace import Graph
from autoshard.trace import jaxpr_compat as jc
from cost_models import CostModel


class FakeFlatTree:
    """The part of jax 0.11's ``jax._src.flattree.FlatTree`` that scan params use: a tuple of parts."""

    def __init__(self, *parts: list[None]) -> None:
        self.parts = parts

    def unpack(self) -> tuple[list[None], ...]:
        return self.parts

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)


def fake_eqn(eqn: Any, params: dict[str, Any]) -> Any:
    """``eqn`` with other params (a stand-in: jax's JaxprEqn is not built by hand)."""
    return types.SimpleNamespace(primitive=eqn.primitive, params=params, invars=eqn.invars, outvars=eqn.outvars,
                                 source_info=eqn.source_info, ctx=getattr(eqn, "ctx", None))


def scan_as_010(eqn: Any, nc: int, ncarry: int) -> dict[str, Any]:
    p = {k: v for k, v in eqn.params.items() if k not in ("ft_in", "ft_out")}
    return p | {"num_consts": nc, "num_carry": ncarry}


def scan_as_011(eqn: Any, nc: int, ncarry: int) -> dict[str, Any]:
    p = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry", "linear")}
    n_xs = len(eqn.invars) - nc - ncarry
    n_ys = len(eqn.outvars) - ncarry
    return p | {"ft_in": FakeFlatTree([None] * nc, [None] * ncarry, [None] * n_xs),
                "ft_out": FakeFlatTree([None] * ncarry, [None] * n_ys)}


def scanned(x: jax.Array, ws: jax.Array, b: jax.Array) -> jax.Array:
    """A scan with 2 constants (b and the closed-over scale), 1 carry, 1 xs and 1 ys."""
    scale = jnp.float32(0.5)

    def body(h: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        h = jnp.tanh(h @ w + b) * scale
        return h, h.sum()

    h, ys = jax.lax.scan(body, x, ws)
    return h.sum() + ys.sum()


ARGS = (jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((3, 16, 16), jnp.float32),
        jax.ShapeDtypeStruct((16,), jnp.float32))


def the_scan(jaxpr: Any) -> Any:
    (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


# ---- scan ------------------------------------------------------------------------------------------------


def test_scan_layout_reads_both_releases() -> None:
    eqn = the_scan(jax.make_jaxpr(scanned)(*ARGS).jaxpr)
    real = jc.scan_layout(eqn)
    assert (real.num_carry, real.num_xs, real.length, real.reverse) == (1, 1, 3, False)
    assert real.num_consts == len(eqn.invars) - 2 and real.stacked_from == real.num_consts + 1
    for layout in (scan_as_010, scan_as_011):
        got = jc.scan_layout(fake_eqn(eqn, layout(eqn, real.num_consts, 1)))
        assert got == real, layout.__name__


def test_scan_params_with_more_constants() -> None:
    eqn = the_scan(jax.make_jaxpr(scanned)(*ARGS).jaxpr)
    nc = jc.scan_layout(eqn).num_consts
    body = jc.scan_body(eqn).jaxpr
    old = fake_eqn(eqn, scan_as_010(eqn, nc, 1) | {"linear": (False,) * len(eqn.invars)})
    p = jc.scan_params(old, body, 2)
    assert p["num_consts"] == nc + 2 and p["linear"] == (False,) * (len(eqn.invars) + 2)
    assert p["jaxpr"].jaxpr is body or p["jaxpr"].jaxpr.eqns == body.eqns
    assert jc.scan_params(old, body, 0)["num_consts"] == nc


def test_scan_params_rebind_under_the_installed_jax() -> None:
    """Hoisting a constant into a leading operand and binding again gives the same numbers."""
    x, ws, b = (np.random.default_rng(i).normal(size=a.shape).astype(np.float32) for i, a in enumerate(ARGS))
    closed = jax.make_jaxpr(scanned)(x, ws, b)
    eqn = the_scan(closed.jaxpr)
    nc = jc.scan_layout(eqn).num_consts
    body = jc.scan_body(eqn)
    extra = jnp.float32(1.0)  # a new leading constant the body ignores

    def rebuilt(*args: Any) -> list[Any]:
        return jax.extend.core.jaxpr_as_fun(body)(*args[1:])

    new_body = jax.make_jaxpr(rebuilt)(extra, *body.jaxpr.in_avals).jaxpr
    outer = dict(zip(closed.jaxpr.invars, (x, ws, b), strict=True))
    outer.update(zip(closed.jaxpr.constvars, closed.consts, strict=True))
    operands = [v.val if isinstance(v, jax.extend.core.Literal) else outer[v] for v in eqn.invars]
    want = eqn.primitive.bind(*operands, **eqn.params)
    got = eqn.primitive.bind(extra, *operands, **jc.scan_params(eqn, new_body, 1))
    assert nc >= 1
    for a, b_ in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b_))


def test_unknown_scan_layout_names_the_op_and_what_to_try() -> None:
    eqn = the_scan(jax.make_jaxpr(scanned)(*ARGS).jaxpr)
    p = {k: v for k, v in eqn.params.items() if k not in ("num_consts", "num_carry", "ft_in", "ft_out")}
    with pytest.raises(TraceError, match=r"'scan' equation has neither 'num_consts'.*jax 0\.10 and 0\.11"):
        jc.scan_layout(fake_eqn(eqn, p))
    bad = p | {"ft_in": FakeFlatTree([None], [None])}
    with pytest.raises(TraceError, match="not a \\(consts, carry, xs\\) tuple"):
        jc.scan_layout(fake_eqn(eqn, bad))
    short = p | {"ft_in": FakeFlatTree([None], [None], [None] * 9)}
    with pytest.raises(TraceError, match="operands but an 'ft_in'"):
        jc.scan_layout(fake_eqn(eqn, short))


def _with_scan_layout(graph: Graph, layout: Any) -> Graph:
    ops = list(graph.ops)
    for i, op in enumerate(ops):
        if op.primitive == "scan":
            real = jc.scan_layout(op.eqn)
            ops[i] = dataclasses.replace(op, eqn=fake_eqn(op.eqn, layout(op.eqn, real.num_consts, real.num_carry)))
    return dataclasses.replace(graph, ops=tuple(ops))


@pytest.mark.parametrize("layout", [scan_as_010, scan_as_011])
def test_planner_builds_the_same_problem_from_either_layout(layout: Any) -> None:
    """The crash of issue #17 (``KeyError: 'num_consts'`` in build_control_flow) on a GPT-like scan."""
    graph = autoshard.trace(jax.grad(scanned, argnums=(0, 1, 2)), *ARGS)
    assert sum(op.primitive == "scan" for op in graph.ops) == 2  # forward and backward
    cost = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("data", "model"))
    want = build_problem(graph, cost, None).problem
    got = build_problem(_with_scan_layout(graph, layout), cost, None).problem
    got.verify()
    assert list(got.node_names) == list(want.node_names)
    np.testing.assert_array_equal(got.edges, want.edges)
    np.testing.assert_array_equal(got.intervals, want.intervals)
    for a, b in [*zip(got.node_costs, want.node_costs, strict=True), *zip(got.edge_costs, want.edge_costs, strict=True)]:
        np.testing.assert_array_equal(a, b)


# ---- while, cond, remat, calls ---------------------------------------------------------------------------


def test_while_cond_and_remat_accessors() -> None:
    def f(x: jax.Array, n: jax.Array) -> jax.Array:
        def loop(c: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            i, y = c
            return i + 1, jnp.sin(y) * x.sum()

        y = jax.lax.while_loop(lambda s: s[0] < 5, lambda s: (s[0] + 1, jnp.cos(s[1]) + x), (0, x))[1]
        _, y = jax.lax.while_loop(lambda c: c[0] < n, loop, (0, y))
        y = jax.lax.cond(n > 2, jnp.sin, jnp.cos, y)
        return jax.checkpoint(lambda v: jnp.tanh(v) * 2.0)(y)

    jaxpr = jax.make_jaxpr(f)(jnp.ones(4), 3).jaxpr
    whiles = [e for e in jaxpr.eqns if e.primitive.name == "while"]
    (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    (remat,) = [e for e in jaxpr.eqns if e.primitive.name in jc.REMAT]
    assert [jc.while_trip_count(e) for e in whiles] == [5, None]
    w = jc.while_layout(whiles[1])
    c_j, b_j = jc.while_bodies(whiles[1])
    assert len(c_j.jaxpr.invars) == w.cond_nconsts + 2 and len(b_j.jaxpr.invars) == w.body_nconsts + 2
    assert w.carry_from == len(whiles[1].invars) - 2
    p = jc.while_params(whiles[1], c_j.jaxpr, b_j.jaxpr, 1, 2)
    assert (p["cond_nconsts"], p["body_nconsts"]) == (w.cond_nconsts + 1, w.body_nconsts + 2)
    branches = jc.cond_branches(cond)
    assert len(branches) == 2 and all(len(b.jaxpr.invars) == len(cond.invars) - 1 for b in branches)
    assert jc.cond_params(cond, list(branches))["branches"] == tuple(branches)
    body = jc.remat_body(remat)
    assert len(body.jaxpr.invars) == len(remat.invars) and not body.consts
    assert jc.remat_params(remat, body.jaxpr)["jaxpr"] is body.jaxpr
    for e, what in ((whiles[0], "cond_nconsts"), (cond, "branches"), (remat, "jaxpr")):
        with pytest.raises(TraceError, match=f"no '{what}"):
            {"while": jc.while_layout, "cond": jc.cond_branches}.get(e.primitive.name, jc.remat_body)(
                fake_eqn(e, {k: v for k, v in e.params.items() if k != what}))


def test_inline_bodies_of_jit_and_custom_jvp() -> None:
    def f(x: jax.Array) -> jax.Array:
        return jax.jit(jax.nn.gelu)(x) + jax.nn.relu(x)  # relu is a custom_jvp

    jaxpr = jax.make_jaxpr(f)(jnp.ones(4)).jaxpr
    calls = [e for e in jaxpr.eqns if jc.inline_body(e) is not None]
    assert {e.primitive.name for e in calls} >= {"custom_jvp_call"}
    assert any(e.primitive.name in ("jit", "pjit") for e in calls)
    for e in calls:
        body = jc.inline_body(e)
        assert len(body.jaxpr.invars) == len(e.invars) and len(body.jaxpr.constvars) == len(body.consts)
    (add,) = [e for e in jaxpr.eqns if e.primitive.name == "add"]
    assert jc.inline_body(add) is None


def test_emitter_and_tracer_import_the_public_names() -> None:
    from autoshard.emit import interpret
    from autoshard.trace import tracer

    assert interpret.jc.REMAT is jc.REMAT and tracer.jc.INLINE_KEYS is jc.INLINE_KEYS
    assert not hasattr(tracer, "_REMAT") and not hasattr(tracer, "_INLINE_KEYS")


# ---- one jaxpr shared by two call sites ------------------------------------------------------------------


def test_a_jaxpr_shared_by_two_calls_keeps_each_calls_constants() -> None:
    """jax caches a jitted function's jaxpr, so two calls with different literal arguments share one
    jaxpr and its variables (optax's two ``tree_bias_correction`` calls, with 0.9 and 0.999, under jax
    0.11). Emission must bind each call with its own values."""
    g = jax.jit(lambda x, d: x * d)

    def f(x: jax.Array) -> jax.Array:
        return g(x, 0.9) + g(x, 0.999) * 10.0

    calls = [e for e in jax.make_jaxpr(f)(jnp.ones(4)).jaxpr.eqns if jc.inline_body(e) is not None]
    assert len(calls) == 2 and calls[0].params["jaxpr"] is calls[1].params["jaxpr"]
    graph = autoshard.trace(f, jax.ShapeDtypeStruct((4,), jnp.float32))
    x = jnp.arange(4.0)
    want = np.asarray(f(x))
    step = emit(graph, {}, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",)))
    (got,) = jax.tree.leaves(step(*step.place(x)))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)
    scalars = {float(np.float32(v)) for t, v in graph.constants.items() if graph.tensors[t].shape == ()}
    assert {float(np.float32(0.9)), float(np.float32(0.999))} <= scalars
