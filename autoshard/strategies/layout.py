"""Rules for data movement: reshape, transpose, broadcast, squeeze/expand, slicing, padding, concatenation,
reversal and windowed ops. They move no data between devices themselves; a dimension keeps its mesh axes
when it survives the op whole, and must be unsplit where the op cuts into it.

reshape maps dimensions group by group (the maximal runs whose sizes multiply to the same product). A
split survives a group when it sits on the group's major dimension on one side and divides the group's
major dimension on the other (``[B, S, H] -> [B*S, H]`` keeps a split of B on the merged dimension); a
1:1 group keeps any split. Transpose, reshape and squeeze also pass pending partial sums through.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def _with_partials(op: Op, ctx: RuleContext, cands: list[Candidate]) -> list[Candidate]:
    out = list(cands)
    for c in cands:
        (i,), (o,) = c.in_specs, c.out_specs
        for a in ctx.axes:
            if a not in i.axes_used and a not in o.axes_used:
                p = frozenset({a})
                out += settle_partial(op, ctx, (ShardingSpec(i.dims, p),), ShardingSpec(o.dims, p))
    return out


@register("transpose")
def transpose(op: Op, ctx: RuleContext) -> list[Candidate]:
    perm = op.eqn.params["permutation"]
    (in_shape,) = ctx.in_shapes(op)
    cands = [
        Candidate((spec,), (ShardingSpec(dims=tuple(spec.dims[p] for p in perm)),))
        for spec in enumerate_specs(in_shape, ctx)
    ]
    return _with_partials(op, ctx, cands)


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of dimensions of shape ``a`` and ``b`` (size-1 dimensions left out) with equal products."""
    ai = [i for i, n in enumerate(a) if n != 1]
    bi = [j for j, n in enumerate(b) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []
    x = y = 0
    while x < len(ai) or y < len(bi):
        ga, gb = [], []
        pa = pb = 1
        while True:
            if pa <= pb and x < len(ai):
                pa *= a[ai[x]]
                ga.append(ai[x])
                x += 1
            elif y < len(bi):
                pb *= b[bi[y]]
                gb.append(bi[y])
                y += 1
            else:
                return None
            if pa == pb and ga and gb:
                break
        groups.append((ga, gb))
    return groups


def _map_spec(spec: ShardingSpec, groups: list[tuple[list[int], list[int]]], src: Sequence[int],
              dst: Sequence[int], ctx: RuleContext) -> ShardingSpec | None:
    dims: list[tuple[str, ...]] = [()] * len(dst)
    for gs, gd in groups:
        if len(gs) == 1 and len(gd) == 1:
            dims[gd[0]] = spec.dims[gs[0]]
            continue
        if any(spec.dims[d] for d in gs[1:]):
            return None
        axes = spec.dims[gs[0]]
        if axes:
            if dst[gd[0]] % ctx.size(axes):
                return None
            dims[gd[0]] = axes
    used = {a for d in spec.dims for a in d}
    if used != {a for d in dims for a in d}:  # a split on a size-1 dimension cannot survive
        return None
    return ShardingSpec(dims=tuple(dims))


@register("reshape", "squeeze", "expand_dims")
def reshape(op: Op, ctx: RuleContext) -> list[Candidate]:
    (in_shape,) = ctx.in_shapes(op)[:1]
    (out_shape,) = ctx.out_shapes(op)
    groups = reshape_groups(in_shape, out_shape)
    if groups is None:
        return []
    extra = tuple(ShardingSpec.replicated(len(s)) for s in ctx.in_shapes(op)[1:])  # dynamic shape operands
    cands = []
    for spec in enumerate_specs(in_shape, ctx):
        out = _map_spec(spec, groups, in_shape, out_shape, ctx)
        if out is not None:
            cands.append(Candidate((spec, *extra), (out,)))
    back = [(g2, g1) for g1, g2 in groups]
    for spec in enumerate_specs(out_shape, ctx):
        src = _map_spec(spec, back, out_shape, in_shape, ctx)
        if src is not None:
            cands.append(Candidate((src, *extra), (spec,)))
    return _with_partials(op, ctx, cands) if not extra else cands


@register("broadcast_in_dim")
def broadcast_in_dim(op: Op, ctx: RuleContext) -> list[Candidate]:
    in_shapes = ctx.in_shapes(op)
    in_shape = in_shapes[0]
    (out_shape,) = ctx.out_shapes(op)
    bdims = op.eqn.params["broadcast_dimensions"]
    extra = tuple(ShardingSpec.replicated(len(s)) for s in in_shapes[1:])
    cands = []
    for spec in enumerate_specs(out_shape, ctx):
        dims = tuple(spec.dims[o] if in_shape[i] == out_shape[o] else () for i, o in enumerate(bdims))
        cands.append(Candidate((ShardingSpec(dims=dims), *extra), (spec,)))
    return cands


@register("slice")
def slice_(op: Op, ctx: RuleContext) -> list[Candidate]:
    (in_shape,) = ctx.in_shapes(op)
    p = op.eqn.params
    strides = p["strides"] or (1,) * len(in_shape)
    cut = {i for i, (s, lim, st) in enumerate(zip(p["start_indices"], p["limit_indices"], strides, strict=True))
           if s != 0 or lim != in_shape[i] or st != 1}
    return passthrough(op, ctx, cut)


@register("dynamic_slice")
def dynamic_slice(op: Op, ctx: RuleContext) -> list[Candidate]:
    in_shape = ctx.in_shapes(op)[0]
    sizes = op.eqn.params["slice_sizes"]
    return passthrough(op, ctx, {i for i, n in enumerate(sizes) if n != in_shape[i]})


@register("dynamic_update_slice")
def dynamic_update_slice(op: Op, ctx: RuleContext) -> list[Candidate]:
    in_shape, upd_shape = ctx.in_shapes(op)[:2]
    return passthrough(op, ctx, {i for i, (a, b) in enumerate(zip(in_shape, upd_shape, strict=True)) if a != b})


@register("split")
def split(op: Op, ctx: RuleContext) -> list[Candidate]:
    """Pieces of a split dimension come from different devices, so that dimension stays whole."""
    (in_shape,) = ctx.in_shapes(op)
    axis = op.eqn.params["axis"]
    outs = ctx.out_shapes(op)
    return [
        Candidate((spec,), tuple(spec for _ in outs))
        for spec in enumerate_specs(in_shape, ctx)
        if not spec.dims[axis]
    ]


def _without_axis(shape: tuple[int, ...], axis: int, ctx: RuleContext) -> list[tuple[ShardingSpec, ShardingSpec]]:
    """Layouts of a stacked tensor whose ``axis`` stays whole, each with the layout of one piece."""
    return [(spec, ShardingSpec(dims=spec.dims[:axis] + spec.dims[axis + 1 :]))
            for spec in enumerate_specs(shape, ctx) if not spec.dims[axis]]


@register("stack")
def stack(op: Op, ctx: RuleContext) -> list[Candidate]:
    """Operands follow the result on every dimension but the new one, which stays whole."""
    (out_shape,) = ctx.out_shapes(op)
    return [Candidate(tuple(piece for _ in op.inputs), (spec,))
            for spec, piece in _without_axis(out_shape, op.eqn.params["axis"], ctx)]


@register("unstack")
def unstack(op: Op, ctx: RuleContext) -> list[Candidate]:
    (in_shape,) = ctx.in_shapes(op)
    return [Candidate((spec,), tuple(piece for _ in op.outputs))
            for spec, piece in _without_axis(in_shape, op.eqn.params["axis"], ctx)]


@register("concatenate")
def concatenate(op: Op, ctx: RuleContext) -> list[Candidate]:
    return passthrough(op, ctx, {op.eqn.params["dimension"]})


@register("pad")
def pad(op: Op, ctx: RuleContext) -> list[Candidate]:
    cfg = op.eqn.params["padding_config"]
    return passthrough(op, ctx, {i for i, c in enumerate(cfg) if tuple(c) != (0, 0, 0)})


@register("rev")
def rev(op: Op, ctx: RuleContext) -> list[Candidate]:
    return passthrough(op, ctx, set(op.eqn.params["dimensions"]))


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          "select_and_scatter_add", "select_and_gather_add")
def windowed(op: Op, ctx: RuleContext) -> list[Candidate]:
    p = op.eqn.params
    win = p.get("window_dimensions", ())
    strides = p.get("window_strides", ())
    padding = p.get("padding", ())
    whole = {i for i, w in enumerate(win) if w != 1}
    whole |= {i for i, s in enumerate(strides) if s != 1}
    whole |= {i for i, pd in enumerate(padding) if tuple(pd) != (0, 0)}
    ins = ctx.in_shapes(op)
    if any(len(s) != len(ctx.out_shapes(op)[0]) and s for s in ins):
        return []
    if any(s != ctx.out_shapes(op)[0] for s in ins if s):  # windows change the extent of those dims
        out = ctx.out_shapes(op)[0]
        whole |= {i for s in ins if s for i, (a, b) in enumerate(zip(s, out, strict=True)) if a != b}
    return passthrough(op, ctx, whole)

