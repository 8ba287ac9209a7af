"""Random draws a pipeline makes exactly as ``jax.jit`` makes them over the whole batch.

A step that draws from a key it is given (dropout: ``random_bits(key, (B, T, D))``, then a comparison) draws,
under ``jax.jit``, one mask over the batch's ``B`` rows. A pipeline runs the step once a microbatch of
``b = B / M`` rows with the same key: left alone, every microbatch would draw the first ``b`` rows' numbers.

Under threefry with ``jax_threefry_partitionable`` (jax's default since 0.5), element ``e`` of a draw (its flat
index in the draw's shape) is ``threefry2x32(key, e)``: the numbers do not depend on the shape beyond the flat
index. Microbatch ``m``'s rows of a draw whose dimension 0 runs over the batch's rows are the flat indices
``m·b·R + e'`` of jit's draw (``R`` the product of the other dimensions, ``e'`` the index in the microbatch's
own draw of ``b·R`` elements): ``emit.draws.offset_bits`` computes exactly those, so the pipeline's masks are
jit's (the emitter's ``Interpreter`` binds it for the draws ``row_draws`` names, given the block's index).

Which draws run over the rows (``row_draws``) is read off the two traces: a draw of the microbatch trace whose
dimension 0 is the microbatch's ``b`` rows and whose shape at full size is ``(M·b, ...)`` runs over them; a
draw whose shape is the same at both sizes (noise on a weight) is the same for every microbatch, as jit draws
it once. Anything else (another impl than threefry, the flag off, a key array, a draw of a shape that is
neither, or a shape that is both, random numbers made without a key's ``random_bits``: ``RAW``) cannot be
made jit's this way: ``row_draws`` returns None and the plan says so (``report.random_note``). A draw over
the rows runs with its microbatch in both runtimes: the MPMD runtime's programs that hold one take the
microbatch's index first; the SPMD program never hoists one before its loop (``uniform_stages``'
``per_microbatch``), where a draw reading no batch value would otherwise run once a step.

The same holds for any smaller slice of a microbatch (the SPMD program's tail spread over stages): a graph
traced at ``1/n`` of the batch runs block ``i`` with offset ``i·b'·R``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import jax

from autoshard.emit.draws import DRAW
from autoshard.pipeline.partition import batch_rows
from autoshard.trace.graph import Graph, Op, Scope


def _draws(graph: Graph, key: Scope = ()) -> Iterator[tuple[Scope, Op]]:
    """Every ``random_bits`` op of ``graph`` and of its bodies, with the scope the emitter gives it."""
    for op in graph.ops:
        if op.primitive == DRAW:
            yield key, op
        for i, body in enumerate(op.bodies):
            yield from _draws(body, (*key, (op.id, i)))


def _shape(graph: Graph, op: Op) -> tuple[int, ...]:
    return tuple(int(d) for d in op.eqn.params["shape"])


# random numbers made without a key's ``random_bits`` (a raw threefry, XLA's generator): not split by rows here
RAW = frozenset({"threefry2x32", "rng_bit_generator", "rng_uniform"})


def _raw(graph: Graph) -> bool:
    return any(op.primitive in RAW or any(_raw(b) for b in op.bodies) for op in graph.ops)


def row_draws(small: Graph, full: Graph, blocks: int) -> frozenset[tuple[Scope, int]] | None:
    """The draws of ``small`` (the step traced at ``1/blocks`` of ``full``'s batch) that run over the batch's
    rows, by (scope, op id); None when some draw cannot be made ``jax.jit``'s (the module docstring)."""
    if not jax.config.jax_threefry_partitionable or _raw(small):
        return None
    rows = batch_rows(small)
    mine = list(_draws(small))
    theirs: set[tuple[int, ...]] = set()
    stack = [full]
    while stack:  # every draw's shape at full size, bodies included
        g = stack.pop()
        for op in g.ops:
            if op.primitive == DRAW:
                theirs.add(_shape(g, op))
            stack.extend(op.bodies)
    out = set()
    for key, op in mine:
        k = op.inputs[0]
        graph = small
        for op_id, body in key:  # the graph the op is in, for its key's tensor
            graph = graph.ops[op_id].bodies[body]
        ten = graph.tensors[k]
        if ten.shape or not ten.dtype.startswith("key<fry"):
            return None  # a key array, or another PRNG implementation
        shape = _shape(graph, op)
        whole = (rows * blocks, *shape[1:]) if shape else None
        same = shape in theirs
        if rows and shape and shape[0] == rows and whole in theirs and blocks > 1:
            if same or math.prod(shape) >= 2 ** 32:
                return None  # both a per-row draw and one of the same shape for the whole step; or too large
            out.add((key, op.id))
        elif not same:
            return None
    return frozenset(out)


def top_op(draw: tuple[Scope, int]) -> int:
    """The top-level op that runs ``draw`` (its scope and op id): the draw itself, or the op whose body holds it."""
    key, op_id = draw
    return key[0][0] if key else op_id


def top_ops(draws: Iterable[tuple[Scope, int]]) -> frozenset[int]:
    return frozenset(map(top_op, draws))


def row_shaped(graph: Graph) -> frozenset[int]:
    """The top-level ops of ``graph`` (a step traced at microbatch size) that hold a draw whose dimension 0 is
    the microbatch's rows: ``row_draws``' guess from this trace alone, where the full-size one is not at hand
    (the planner's own cut of uniform stages, which must be the cut the SPMD program makes)."""
    rows = batch_rows(graph)
    return top_ops((key, op.id) for key, op in _draws(graph)
                   if rows and (shape := op.eqn.params["shape"]) and int(shape[0]) == rows)
