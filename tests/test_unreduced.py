"""``pipeline.unreduced`` on scatter-adds: an embedding's gradient, the rows of a data-parallel batch added
into zeros, is a partial sum over the axes the rows are split over, returned stacked with no collective;
a scatter-add it cannot prove that of (an operand split over those axes or not zeros, indices not split
with their rows) is left to XLA."""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from autoshard.emit import global_rel_error
from autoshard.pipeline.unreduced import UnreducedInterpreter, plan_stacked, produced_partial
from autoshard.trace import trace
from autoshard.trace.graph import Graph, Op
from cost_models import ShardingSpec

V, H, R, T = 40, 24, 8, 4  # vocabulary, hidden, rows of the batch, tokens a row
TOL = 1e-5
MESH = {"x": 2, "y": 4}
_REDUCES = re.compile(r"\b(?:all-reduce|reduce-scatter)(?:-start)?\(")


def _lookup_grad(tokens: jax.Array, g: jax.Array) -> jax.Array:
    """The gradient of an embedding table [V, H] under a lookup of ``tokens`` weighted by ``g``."""
    return jax.grad(lambda t: jnp.sum(t[tokens] * g))(jnp.ones((V, H)))


def _add_into(table: jax.Array, tokens: jax.Array, g: jax.Array) -> jax.Array:
    return table.at[tokens].add(g)


def _position_grad(positions: jax.Array, g: jax.Array) -> jax.Array:
    """A position embedding's gradient: the rows' sum (a partial sum over their axes), then a scatter-add."""
    return jnp.zeros((T, H)).at[positions].add(g.sum(0))


def _inputs() -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.key(0), (R, T), 0, V)
    return tokens, jax.random.normal(jax.random.key(1), (R, T, H))


def _scatter(graph: Graph) -> Op:
    (op,) = [op for op in graph.ops if op.primitive in ("scatter-add", "scatter_add")]
    return op


def _specs(graph: Graph, rows: tuple[str, ...], hidden: tuple[str, ...] = ()) -> dict[int, ShardingSpec]:
    """The batch's rows split over ``rows``, the hidden dimension of every value with one over ``hidden``."""
    out = {}
    for t in graph.tensors:
        if t.shape and t.shape[0] == R:
            last = (hidden,) if len(t.shape) > 1 and t.shape[-1] == H else ((),)
            out[t.id] = ShardingSpec(dims=(rows,) + ((),) * (len(t.shape) - 2) + last)
    return out


def test_a_scatter_add_of_split_rows_into_zeros_is_partial_over_the_rows_axes() -> None:
    g = trace(_lookup_grad, *_inputs())
    op = _scatter(g)
    zeros, indices, updates = op.inputs
    assert produced_partial(op, g, _specs(g, ("x", "y"))) == ("x", "y")  # the zeros without a layout: whole
    specs = _specs(g, ("x",), ("y",)) | {zeros: ShardingSpec(dims=((), ("y",)))}
    assert produced_partial(op, g, specs) == ("x",)  # the hidden dimension split alike on both
    # the operand split over the rows' axes (its rows, or its hidden dimension)
    assert produced_partial(op, g, _specs(g, ("x",)) | {zeros: ShardingSpec(dims=(("x",), ()))}) == ()
    assert produced_partial(op, g, _specs(g, ("x",)) | {zeros: ShardingSpec(dims=((), ("x",)))}) == ()
    # the operand's hidden dimension split, the updates' not; the operand a pending sum
    assert produced_partial(op, g, _specs(g, ("x",)) | {zeros: ShardingSpec(dims=((), ("y",)))}) == ()
    assert produced_partial(op, g, _specs(g, ("x",)) | {zeros: ShardingSpec(dims=((), ()), partial={"y"})}) == ()
    # the indices split otherwise than their rows, or of no known layout
    assert produced_partial(op, g, _specs(g, ("x",)) | {indices: ShardingSpec(dims=(("y",), (), ()))}) == ()
    assert produced_partial(op, g, _specs(g, ("x",)) | {indices: ShardingSpec(dims=((), (), ()))}) == ()
    assert produced_partial(op, g, {t: s for t, s in _specs(g, ("x",)).items() if t != indices}) == ()
    # the updates already a pending sum
    partial = ShardingSpec(dims=(("x",), (), ()), partial={"y"})
    assert produced_partial(op, g, _specs(g, ("x",)) | {updates: partial}) == ()


@pytest.mark.parametrize("fn", [_add_into, lambda _, tokens, g: jnp.ones((V, H)).at[tokens].add(g),
                                lambda _, tokens, g: jnp.ones((T, H)).at[jnp.arange(T)].add(g.sum(0))],
                         ids=["argument", "ones", "ones-rows-summed"])
def test_a_scatter_add_into_a_table_that_is_not_zeros_is_left_to_xla(fn: Callable[..., jax.Array]) -> None:
    # each device would add the table once: D copies of it in the stack's sum
    tokens, rows = _inputs()
    g = trace(fn, jnp.ones((V, H)), tokens, rows)
    op = _scatter(g)
    specs = _specs(g, ("x",))
    assert produced_partial(op, g, specs) == ()
    assert plan_stacked(g, g.ops, specs, g.outputs)[0].keys().isdisjoint(g.outputs)


def _run_stacked(graph: Graph, args: tuple[jax.Array, ...], specs: dict[int, ShardingSpec]
                 ) -> tuple[jax.Array, str, tuple[str, ...]]:
    """``graph``'s output stacked (``unreduced``) on a 2 x 4 mesh, the compiled text, the stacked axes."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(MESH["x"], MESH["y"]), tuple(MESH))
    stacked, producers = plan_stacked(graph, graph.ops, specs, graph.outputs)
    (out,) = graph.outputs
    assert out in stacked, "the output should leave stacked"
    interp = UnreducedInterpreter(mesh, {(): specs}, stacked, producers)
    run = jax.jit(lambda *xs: interp.run_ops(graph, graph.ops, graph.inputs, xs, graph.outputs)[0],
                  out_shardings=interp.stacked_sharding(out))
    return run(*args), run.lower(*args).compile().as_text(), stacked[out]


@pytest.mark.parametrize("rows,hidden", [(("x", "y"), ()), (("x",), ("y",))])
def test_the_stacked_embedding_gradient_sums_to_the_gradient_with_no_collective(
        rows: tuple[str, ...], hidden: tuple[str, ...]) -> None:
    args = _inputs()
    g = trace(_lookup_grad, *args)
    specs = _specs(g, rows, hidden)
    if hidden:
        specs[_scatter(g).inputs[0]] = ShardingSpec(dims=((), hidden))
    got, hlo, axes = _run_stacked(g, args, specs)
    assert axes == rows and got.shape == (int(np.prod([MESH[a] for a in rows])), V, H)
    assert global_rel_error(_lookup_grad(*args), got.sum(0)) <= TOL
    assert not _REDUCES.search(hlo)


def test_a_position_embeddings_gradient_takes_its_stacked_rows_sum() -> None:
    # the rows' sum is partial over the rows' axes; the scatter-add into zeros adds each stacked slice
    args = (jnp.arange(T), _inputs()[1])
    g = trace(_position_grad, *args)
    got, hlo, axes = _run_stacked(g, args, _specs(g, ("x", "y")))
    assert axes == ("x", "y") and got.shape == (8, T, H)
    assert global_rel_error(_position_grad(*args), got.sum(0)) <= TOL
    assert not _REDUCES.search(hlo)
