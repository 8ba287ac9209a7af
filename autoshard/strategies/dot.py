"""Rules for ``dot_general`` and ``conv_general_dilated``.

dot_general (Alpa §4.1, GSPMD §3.3): the operands' dimensions fall into four classes: batch (in both),
lhs-free, rhs-free and contracting. Each mesh axis is given to at most one of these logical dimensions
(or to none). Splitting batch or free dimensions splits the output; splitting a contracting dimension
leaves every device with a partial sum of the whole output: the output spec carries ``partial={axis}``.

- If the output has at most one consumer, the partial sum is left pending: the edge to the consumer pays
  the cheapest reduction the consumer's spec allows (all-reduce to replicate it, reduce-scatter to split
  it: the ZeRO / sequence-parallel choice), or the consumer is linear and passes it on.
- With several consumers, each edge would pay the reduction again, so the op reduces itself, once: an
  all-reduce, or a reduce-scatter into a split output (``registry.settle_partial``).

Megatron's column-parallel layer is (x: R, W: S(model) on its free dim) -> S(model) on the output's free
dim; the row-parallel layer is (x: S(model) on contracting, W: S(model) on contracting) -> P(model).

conv_general_dilated: batch and output-feature dimensions may be split (data parallel and
filter-parallel), and the input-feature dimension as a contracting dimension (partial output). Spatial
dimensions stay whole (halo exchange is not modelled).
"""

from __future__ import annotations

import itertools

from autoshard.strategies.registry import Candidate, RuleContext, assignments, register, settle_partial
from autoshard.trace.graph import Op
from cost_models import ShardingSpec


def _finish(ctx: RuleContext, op: Op, lhs: ShardingSpec, rhs: ShardingSpec, out_dims: list[tuple[str, ...]],
            contract_axes: tuple[str, ...]) -> list[Candidate]:
    partial = frozenset(contract_axes)
    work = frozenset(a for d in out_dims for a in d) | partial
    return settle_partial(op, ctx, (lhs, rhs), ShardingSpec(dims=tuple(out_dims), partial=partial), work,
                          pending=False)


@register("dot_general")
def dot_general(op: Op, ctx: RuleContext) -> list[Candidate]:
    lhs_shape, rhs_shape = ctx.in_shapes(op)
    dn = op.eqn.params["dimension_numbers"]
    (lc, rc), (lb, rb) = dn
    lf = [d for d in range(len(lhs_shape)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rhs_shape)) if d not in rc and d not in rb]
    # logical dimensions: (lhs dim or None, rhs dim or None, output dim or None)
    logical: list[tuple[int | None, int | None, int | None]] = []
    for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
        logical.append((a, b, i))
    for j, a in enumerate(lf):
        logical.append((a, None, len(lb) + j))
    for j, b in enumerate(rf):
        logical.append((None, b, len(lb) + len(lf) + j))
    for a, b in zip(lc, rc, strict=True):
        logical.append((a, b, None))
    sizes = [lhs_shape[a] if a is not None else rhs_shape[b] for a, b, _ in logical]
    n_out = len(lb) + len(lf) + len(rf)

    cands = []
    for slots in assignments(sizes, ctx, max_axes_per_dim=2):
        lhs_dims: list[tuple[str, ...]] = [()] * len(lhs_shape)
        rhs_dims: list[tuple[str, ...]] = [()] * len(rhs_shape)
        out_dims: list[tuple[str, ...]] = [()] * n_out
        contract: list[str] = []
        for (a, b, o), axes in zip(logical, slots, strict=True):
            if a is not None:
                lhs_dims[a] = axes
            if b is not None:
                rhs_dims[b] = axes
            if o is not None:
                out_dims[o] = axes
            else:
                contract.extend(axes)
        cands.extend(
            _finish(ctx, op, ShardingSpec(dims=tuple(lhs_dims)), ShardingSpec(dims=tuple(rhs_dims)), out_dims,
                    tuple(contract))
        )
    return cands


@register("conv_general_dilated")
def conv(op: Op, ctx: RuleContext) -> list[Candidate]:
    lhs_shape, rhs_shape = ctx.in_shapes(op)
    (out_shape,) = ctx.out_shapes(op)
    p = op.eqn.params
    lhs_spec, rhs_spec, out_spec = p["dimension_numbers"]
    groups = p["feature_group_count"] * p["batch_group_count"]
    batch_dim, in_feat_dim = lhs_spec[0], lhs_spec[1]
    out_feat_rhs, in_feat_rhs = rhs_spec[0], rhs_spec[1]
    out_batch, out_feat = out_spec[0], out_spec[1]
    sizes = [lhs_shape[batch_dim], rhs_shape[out_feat_rhs], 1 if groups > 1 else rhs_shape[in_feat_rhs]]
    cands = []
    for slots in assignments(sizes, ctx, max_axes_per_dim=2):
        b_axes, f_axes, c_axes = slots
        lhs_dims: list[tuple[str, ...]] = [()] * len(lhs_shape)
        rhs_dims: list[tuple[str, ...]] = [()] * len(rhs_shape)
        out_dims: list[tuple[str, ...]] = [()] * len(out_shape)
        lhs_dims[batch_dim], out_dims[out_batch] = b_axes, b_axes
        rhs_dims[out_feat_rhs], out_dims[out_feat] = f_axes, f_axes
        lhs_dims[in_feat_dim], rhs_dims[in_feat_rhs] = c_axes, c_axes
        cands.extend(
            _finish(ctx, op, ShardingSpec(dims=tuple(lhs_dims)), ShardingSpec(dims=tuple(rhs_dims)), out_dims,
                    tuple(itertools.chain(c_axes)))
        )
    return cands
