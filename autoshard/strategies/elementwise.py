"""Rules for elementwise ops: every operand follows the output's sharding.

Operands of lower extent (scalars, size-1 broadcast dimensions, which jax 0.10 allows on equal-rank
operands) are replicated on the dimensions they broadcast along. Linear ops also pass pending partial
sums through (after OneFlow's SBP signatures): ``add``/``sub``/``add_any`` of two P(a) operands is P(a);
``neg``/``convert``/``copy`` of P(a) is P(a); ``mul`` with one P(a) operand and one ordinary operand is
P(a), and so is ``div`` with a P(a) numerator. Deferring the reduction this way lets gradient
accumulation (``add_any``) reduce once instead of once per term.
"""

from __future__ import annotations

import math

from autoshard.strategies.registry import Candidate, RuleContext, enumerate_specs, register, settle_partial
from autoshard.trace.costs import ELEMENTWISE
from autoshard.trace.graph import Op
from cost_models import ShardingSpec

_LINEAR_ALL = frozenset({"add", "sub", "add_any"})
_LINEAR_UNARY = frozenset({"neg", "convert_element_type", "copy", "copy_p", "reduce_precision"})
_LINEAR_FIRST = frozenset({"div"})
_LINEAR_ANY = frozenset({"mul"})
UNARY_FOLLOWERS = frozenset(
    {"convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient", "optimization_barrier"}
)


def operand_spec(out: ShardingSpec, out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> ShardingSpec:
    """The spec an elementwise operand needs when the output is ``out``."""
    if not in_shape:
        return ShardingSpec(dims=())
    dims = tuple(d if n == m else () for d, n, m in zip(out.dims, in_shape, out_shape, strict=True))
    return ShardingSpec(dims=dims)


def _partial_variants(op: Op, ctx: RuleContext, base: ShardingSpec, ins: list[tuple[int, ...]],
                      out_shape: tuple[int, ...]) -> list[Candidate]:
    name = op.primitive
    out: list[Candidate] = []
    for a in ctx.axes:
        if a in base.axes_used:
            continue
        p = ShardingSpec(dims=base.dims, partial=frozenset({a}))
        plain = [operand_spec(base, out_shape, s) for s in ins]
        if name in _LINEAR_ALL and all(s == out_shape for s in ins):
            out += settle_partial(op, ctx, tuple(p for _ in ins), p)
        elif name in _LINEAR_UNARY and len(ins) == 1 and ins[0] == out_shape:
            out += settle_partial(op, ctx, (p,), p)
        elif name in _LINEAR_FIRST and ins[0] == out_shape:
            out += settle_partial(op, ctx, (p, *plain[1:]), p)
        elif name in _LINEAR_ANY and len(ins) == 2:
            for k in (0, 1):
                if ins[k] == out_shape:
                    specs = list(plain)
                    specs[k] = p
                    out += settle_partial(op, ctx, tuple(specs), p)
    return out


@register(*ELEMENTWISE, *UNARY_FOLLOWERS)
def elementwise(op: Op, ctx: RuleContext) -> list[Candidate]:
    ins = ctx.in_shapes(op)
    outs = ctx.out_shapes(op)
    out_shape = outs[0]
    if any(s != out_shape for s in outs):
        return []
    cands = []
    for spec in enumerate_specs(out_shape, ctx):
        in_specs = tuple(operand_spec(spec, out_shape, s) for s in ins)
        cands.append(Candidate(in_specs, tuple(spec for _ in outs)))
        cands += _partial_variants(op, ctx, spec, ins, out_shape)
    return cands


@register("optimization_barrier")
def barrier(op: Op, ctx: RuleContext) -> list[Candidate]:
    """An identity on each operand (result ``k`` is operand ``k``). One operand, or all of one shape: as
    elementwise. Operands of several shapes (the stash ``trace.remat`` holds with an anchor until the
    backward pass, activations of ``[b, s, h]``, ``[b, s, 4h]``...): one candidate per layout of the
    largest operand, every other operand of its rank taking it on each dimension the axes divide
    (replicated on the others), operands of another rank replicated. Before, no candidate fitted several
    shapes and the barrier was replicated whole: GPT-39B's full-recompute step held 175 GB there."""
    ins = ctx.in_shapes(op)
    if len(set(ins)) <= 1:
        return elementwise(op, ctx)
    largest = max(ins, key=math.prod)

    def fit(spec: ShardingSpec, shape: tuple[int, ...]) -> ShardingSpec:
        if len(shape) != len(largest):
            return ShardingSpec.replicated(len(shape))
        return ShardingSpec(dims=tuple(d if n % ctx.size(d) == 0 else () for d, n in zip(spec.dims, shape,
                                                                                          strict=True)))

    out = []
    for spec in enumerate_specs(largest, ctx):
        specs = tuple(fit(spec, shape) for shape in ins)
        out.append(Candidate(specs, specs))
    return out


@register("iota", "empty", "empty2", "full", "broadcast")
def generated(op: Op, ctx: RuleContext) -> list[Candidate]:
    """Values made from nothing (iota, constants): any layout, made locally."""
    ins = ctx.in_shapes(op)
    (out_shape,) = ctx.out_shapes(op)
    return [
        Candidate(tuple(ShardingSpec.replicated(len(s)) for s in ins), (spec,))
        for spec in enumerate_specs(out_shape, ctx)
    ]


@register("bitcast_convert_type")
def bitcast(op: Op, ctx: RuleContext) -> list[Candidate]:
    """Same bit width: elementwise. A width change adds or drops a minor dimension (PRNG bits): no candidate,
    so the op is replicated."""
    if ctx.in_shapes(op) != ctx.out_shapes(op):
        return []
    return elementwise(op, ctx)
