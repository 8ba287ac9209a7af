"""Rules for gather and scatter, as used by embeddings, ``take_along_axis`` (cross-entropy) and their
gradients.

gather: the result's batch dimensions come from the indices (index passthrough), its offset dimensions
from whole slices of the operand (operand passthrough); batching dimensions (``operand_batching_dims``
paired with ``start_indices_batching_dims``) split operand, indices and result alike. Dimensions that are
indexed into stay unsplit on the operand (vocabulary-parallel lookups with masking are not modelled).

scatter-add: the mirror image. Splitting the updates' scatter dimensions (the tokens of an embedding
gradient) leaves every device with a partial sum of the whole operand: the result is ``partial`` over
those axes, exactly the data-parallel gradient of an embedding table. Plain ``scatter`` (overwrite) has
no partial form, so only passthrough dimensions may be split.
"""

from __future__ import annotations

from autoshard.strategies.registry import Candidate, RuleContext, enumerate_specs, register
from autoshard.trace.graph import Op
from cost_models import ShardingSpec


@register("gather")
def gather(op: Op, ctx: RuleContext) -> list[Candidate]:
    operand_shape, idx_shape = ctx.in_shapes(op)
    (out_shape,) = ctx.out_shapes(op)
    p = op.eqn.params
    dn = p["dimension_numbers"]
    slice_sizes = p["slice_sizes"]
    offset_dims = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    operand_offset = [d for d in range(len(operand_shape)) if d not in collapsed and d not in op_batch]
    idx_dims = list(range(len(idx_shape) - 1))  # the last indices dimension holds the index vectors
    batch_out = [d for d in range(len(out_shape)) if d not in offset_dims]
    cands = []
    for spec in enumerate_specs(out_shape, ctx):
        operand = [()] * len(operand_shape)
        idx = [()] * len(idx_shape)
        ok = True
        for o, i in zip(batch_out, idx_dims, strict=True):
            idx[i] = spec.dims[o]
            if i in idx_batch:
                operand[op_batch[idx_batch.index(i)]] = spec.dims[o]
        for o, d in zip(offset_dims, operand_offset, strict=True):
            if spec.dims[o]:
                if slice_sizes[d] != operand_shape[d]:
                    ok = False
                    break
                operand[d] = spec.dims[o]
        if ok:
            cands.append(Candidate((ShardingSpec(tuple(operand)), ShardingSpec(tuple(idx))), (spec,)))
    return cands


@register("scatter-add", "scatter_add", "scatter")
def scatter(op: Op, ctx: RuleContext) -> list[Candidate]:
    operand_shape, idx_shape, upd_shape = ctx.in_shapes(op)[:3]
    p = op.eqn.params
    dn = p["dimension_numbers"]
    window = tuple(dn.update_window_dims)
    inserted = set(dn.inserted_window_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    operand_window = [d for d in range(len(operand_shape)) if d not in inserted and d not in op_batch]
    scatter_upd = [d for d in range(len(upd_shape)) if d not in window]
    idx_dims = list(range(len(idx_shape) - 1))
    additive = op.primitive != "scatter"
    cands = []
    for spec in enumerate_specs(upd_shape, ctx):
        operand = [()] * len(operand_shape)
        idx = [()] * len(idx_shape)
        partial: set[str] = set()
        ok = True
        for u, d in zip(window, operand_window, strict=True):
            if spec.dims[u]:
                if upd_shape[u] != operand_shape[d]:
                    ok = False
                    break
                operand[d] = spec.dims[u]
        for u, i in zip(scatter_upd, idx_dims, strict=True):
            idx[i] = spec.dims[u]
            if i in idx_batch:
                operand[op_batch[idx_batch.index(i)]] = spec.dims[u]
            elif spec.dims[u]:
                partial.update(spec.dims[u])
        if not ok or (partial and not additive):
            continue
        out = ShardingSpec(tuple(operand), frozenset(partial))
        extra = tuple(ShardingSpec.replicated(len(s)) for s in ctx.in_shapes(op)[3:])
        cands.append(Candidate((out, ShardingSpec(tuple(idx)), spec, *extra), (out,),
                               work_axes=spec.axes_used))
    return cands
