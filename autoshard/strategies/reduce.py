"""Rules for reductions and scans along a dimension.

``reduce_sum`` over a split dimension leaves a partial sum (``partial={axis}``), reduced where a consumer
needs it (softmax denominators, losses, the gradient of a broadcast). ``reduce_max``/``min``/``prod``/
``and``/``or`` and ``argmax``/``argmin`` over a split dimension reduce inside the op with an all-reduce
(max is not a sum, so it cannot be left pending). Cumulative ops and sorts need their dimension whole.
"""

from __future__ import annotations

from autoshard.strategies.registry import (
    Candidate,
    RuleContext,
    enumerate_specs,
    passthrough,
    register,
    settle_partial,
)
from autoshard.trace.graph import Op
from cost_models import ShardingSpec


def _reduced_axes(op: Op) -> tuple[int, ...]:
    return tuple(op.eqn.params["axes"])


@register("reduce_sum")
def reduce_sum(op: Op, ctx: RuleContext) -> list[Candidate]:
    (in_shape,) = ctx.in_shapes(op)
    red = _reduced_axes(op)
    cands = []
    for spec in enumerate_specs(in_shape, ctx):
        kept = tuple(d for i, d in enumerate(spec.dims) if i not in red)
        partial = frozenset(a for i, d in enumerate(spec.dims) if i in red for a in d)
        out = ShardingSpec(dims=kept, partial=partial)
        cands += settle_partial(op, ctx, (spec,), out, work_axes=spec.axes_used)
    return cands


@register("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "argmax", "argmin")
def reduce_other(op: Op, ctx: RuleContext) -> list[Candidate]:
    (in_shape,) = ctx.in_shapes(op)
    red = _reduced_axes(op)
    out_tid = op.outputs[0]
    cands = []
    for spec in enumerate_specs(in_shape, ctx):
        kept = ShardingSpec(dims=tuple(d for i, d in enumerate(spec.dims) if i not in red))
        reduced = tuple(a for i, d in enumerate(spec.dims) if i in red for a in d)
        comm = ()
        if reduced:
            per_device = ctx.graph.tensors[out_tid].nbytes / max(1, kept.num_shards(ctx.mesh))
            factor = 2.0 if op.primitive in ("argmax", "argmin") else 1.0  # value and index travel together
            comm = (("all_reduce", reduced, factor * per_device),)
        cands.append(Candidate((spec,), (kept,), comm=comm, work_axes=spec.axes_used))
    return cands


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(op: Op, ctx: RuleContext) -> list[Candidate]:
    return passthrough(op, ctx, {op.eqn.params["axis"]})


@register("sort")
def sort(op: Op, ctx: RuleContext) -> list[Candidate]:
    return passthrough(op, ctx, {op.eqn.params["dimension"]})


@register("top_k")
def top_k(op: Op, ctx: RuleContext) -> list[Candidate]:
    (in_shape,) = ctx.in_shapes(op)
    last = len(in_shape) - 1
    cands = []
    for spec in enumerate_specs(in_shape, ctx):
        if spec.dims[last]:
            continue
        cands.append(Candidate((spec,), (spec, spec)))
    return cands
