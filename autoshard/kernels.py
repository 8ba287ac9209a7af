"""Kernels that run on each device's shard: ``splittable(fn, rule, split=...)``, and ``ring_attention(block,
backward)``, attention whose sequence may be split too (a ring of such calls: ``autoshard.ring``).

A compiled kernel (a Pallas kernel on a GPU or TPU, an ``ffi_call``) is an opaque custom call to XLA: under
``jax.jit`` with sharded operands, XLA gathers its operands and runs it whole on every device, whatever the
plan priced. ``splittable`` wraps a function (typically one that calls a kernel) in jax's
``custom_partitioning`` with a sharding rule in Shardy's notation, so that XLA runs ``fn`` on each device's
shard instead, at the shard's shapes (``fn`` is traced again there: a Pallas call sizes its grid from them).

    attend = autoshard.splittable(my_attention, "b q h d, b k h d, b k h d -> b q h d", split=("b", "h"))

``split`` names the factors ``fn``'s work is independent over (batch, heads): each must name a dimension of
a result. Every other factor is declared need-replication, so a layout that splits it is gathered before
the call. The planner reads the same rule (``strategies.custom``: a ``custom_partitioning`` op), prices the
call by the flops of what it calls (a registered kernel's, ``register_rule``), on the matmul units when most
of them are matrix products, and the emitted program runs it per shard.

``custom_partitioning`` has no derivative of its own, so ``splittable`` gives the function one: its backward
is a second splittable call, of ``backward(*operands, *result_cotangents) -> operand_cotangents`` (by default
``jax.vjp`` of ``fn``, which runs ``fn``'s forward again inside it, as a recomputed block does), under the
rule ``operands, results -> operands`` with the same split factors (each must then name a dimension of an
operand too). ``examples/gpt.py``'s ``flash_attention`` is one such call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from autoshard import ring as ring_lib
from autoshard.ring import Ring
from autoshard.strategies.custom import parse_rule

Factors = tuple[str, ...]


def splittable(fn: Callable[..., Any], sharding_rule: str, *, split: Iterable[str],
               backward: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``fn`` run on each device's shard of the ``split`` factors of ``sharding_rule``, differentiable (module
    docstring). ``fn`` takes arrays and returns an array or a tuple of arrays, one per result of the rule;
    ``backward`` (default: ``jax.vjp`` of ``fn``) takes the operands and the results' cotangents and returns
    the operands' cotangents (operands are floating-point arrays)."""
    ins, outs = parse_rule(sharding_rule)
    split = frozenset(split)
    forward = _per_shard(fn, sharding_rule, split)
    alone = sorted(split - {e for m in ins for e in m})
    if alone:
        raise ValueError(f"splittable: split names {alone}, which no operand of {sharding_rule!r} has, so its "
                         "backward (operands and cotangents -> the operands' cotangents) could not be split "
                         "along it; leave it out of split")
    lhs, rhs = (side.strip() for side in sharding_rule.split("->"))
    if backward is None:
        def backward(*args: Any) -> Any:
            primals, cotangents = args[:len(ins)], args[len(ins):]
            _, pull = jax.vjp(fn, *primals)
            return pull(tuple(cotangents) if len(outs) > 1 else cotangents[0])
    grad = _per_shard(backward, f"{lhs}, {rhs} -> {lhs}", split)

    @jax.custom_vjp
    def call(*args: Any) -> Any:
        return forward(*args)

    def call_forward(*args: Any) -> tuple[Any, tuple[Any, ...]]:
        return forward(*args), args

    def call_backward(args: tuple[Any, ...], cotangent: Any) -> tuple[Any, ...]:
        got = grad(*args, *(cotangent if len(outs) > 1 else (cotangent,)))
        return tuple(got) if isinstance(got, tuple | list) else (got,)

    call.defvjp(call_forward, call_backward)
    return call


ATTENTION = "b s h d, b s h d, b s h d -> b s h d, b h s"
ATTENTION_BACKWARD = "b s h d, b s h d, b s h d, b s h d, b h s, b s h d -> b s h d, b s h d, b s h d"


def ring_attention(block: ring_lib.Block = ring_lib.reference_block,
                   backward: ring_lib.BlockBackward = ring_lib.reference_block_backward, *,
                   skips_masked: bool | None = None, causal: bool = True) -> Callable[[Any, Any, Any], Any]:
    """Causal (or, ``causal=False``, bidirectional) self-attention ``attend(q, k, v) -> out`` over ``[batch,
    seq, heads, head_dim]`` that the planner may split over batch and heads and, as a ring (zig-zag when
    causal), along the sequence (context parallelism; ``autoshard.ring``).

    ``block(q, k, v, causal) -> (out, lse)``: attention of a block of queries over a block of keys and values,
    with the rows' log-sum-exps (fp32 ``[b, h, sq]``); ``backward(q, k, v, out, lse, dout, causal) -> (dq, dk,
    dv)``: one block's gradients given the rows' global ``out`` and ``lse``. They default to
    ``autoshard.ring.reference_block`` and ``reference_block_backward`` (jnp, scores materialised a block
    at a time: a transient inside the call that the planner's memory model does not see); a fused kernel
    (FlashAttention) goes in their place. ``skips_masked``: whether ``block`` skips the work a causal mask
    hides, as flash kernels do (default: True for a kernel given, False for the reference); the planner
    prices the ring's work from it. Both calls are ``custom_partitioning`` calls, so each device runs them
    on its shard, at the shard's shapes."""
    if skips_masked is None:
        skips_masked = block is not ring_lib.reference_block
    travel = (1, 2)  # k and v go round the ring
    fwd_ring = Ring("s", travel=travel, skips_masked=skips_masked, causal=causal)
    bwd_ring = Ring("s", travel=travel, back=(1, 2), skips_masked=skips_masked, causal=causal)
    split = frozenset({"b", "h"})

    def whole_forward(q: Any, k: Any, v: Any) -> Any:
        return block(q, k, v, causal)

    def whole_backward(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any) -> Any:
        return backward(q, k, v, out, lse, dout, causal)

    forward = _per_shard(whole_forward, ATTENTION, split, fwd_ring,
                         lambda axes, n: lambda *a: ring_lib.ring_forward(block, axes, n, *a, causal=causal))
    grad = _per_shard(whole_backward, ATTENTION_BACKWARD, split, bwd_ring,
                      lambda axes, n: lambda *a: ring_lib.ring_backward(backward, axes, n, *a, causal=causal))

    @jax.custom_vjp
    def attend(q: Any, k: Any, v: Any) -> Any:
        ring_lib.check_shapes(q, k, v)
        return forward(q, k, v)[0]

    def attend_forward(q: Any, k: Any, v: Any) -> tuple[Any, tuple[Any, ...]]:
        ring_lib.check_shapes(q, k, v)
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_backward(res: tuple[Any, ...], dout: Any) -> tuple[Any, ...]:
        return tuple(grad(*res, dout))

    attend.defvjp(attend_forward, attend_backward)
    return attend


def _per_shard(fn: Callable[..., Any], sharding_rule: str, split: frozenset[str], ring: Ring | None = None,
               local: Callable[[Any, int], Callable[..., Any]] | None = None) -> Callable[..., Any]:
    """``fn`` as a ``custom_partitioning`` call of ``sharding_rule``: run per shard of the ``split`` factors,
    every other factor need-replication; with a ``ring``, its factor may be split too, and each device then
    runs ``local(mesh axes, their size)`` (``autoshard.ring``)."""
    ins, outs = parse_rule(sharding_rule)
    for m in (*ins, *outs):
        for e in m:
            if not isinstance(e, str) or e.startswith("…"):
                raise ValueError(f"splittable: the rule {sharding_rule!r} may name plain factors only (no '...' "
                                 "or compound '(a b)' factors); name each dimension")
    in_results = {e for m in outs for e in m}
    wrong = sorted(split - in_results)
    if wrong:
        raise ValueError(f"splittable: split names {wrong}, which no result of {sharding_rule!r} has; a function "
                         "is split only along dimensions of its results")
    order = [e for m in (*ins, *outs) for e in m]
    free = split | ({ring.factor} if ring is not None else set())
    keep = tuple(dict.fromkeys(e for e in order if e not in free))  # sorted by first use, as Shardy wants

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> tuple[Any, ...]:
        # operand and result shardings that agree factor by factor, from the results' split factors
        axes = _split_axes(outs, _leaves(result_shape), free)
        res = _shardings(mesh, outs, axes)
        out = tuple(res) if isinstance(result_shape, tuple | list) else res[0]
        run = fn
        if ring is not None and axes.get(ring.factor) is not None:
            along = axes[ring.factor]
            n = math.prod(mesh.shape[a] for a in (along if isinstance(along, tuple) else (along,)))
            seq = _leaves(result_shape)[0].shape[outs[0].index(ring.factor)]
            if ring.causal and seq % (2 * n):
                raise ValueError(
                    f"ring_attention: the sequence ({seq}) is split over {n} devices (mesh axes {along}), but the "
                    f"zig-zag ring needs it in {2 * n} equal chunks; use a sequence length divisible by {2 * n}, or "
                    "split it over fewer devices")
            run = local(along, n)
        return mesh, run, out, tuple(_shardings(mesh, ins, axes))

    def infer(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        res = _shardings(mesh, outs, _split_axes(ins, arg_shapes, free))
        return tuple(res) if isinstance(result_shape, tuple | list) else res[0]

    if ring is not None:
        partition.autoshard_ring = ring  # type: ignore[attr-defined]  # read by strategies.custom
    # jit: each call traces ``fn`` again at its operands' shapes, and a model calls it once a layer (a Pallas
    # kernel traced in interpret mode, on a machine without the GPU, cost a 70B Llama's trace ~60% of its time);
    # jit's trace cache makes every call after the first at the same shapes a lookup
    wrapped = custom_partitioning(jax.jit(fn))
    wrapped.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=sharding_rule,
                          need_replication_factors=keep)
    return wrapped


def _leaves(tree: Any) -> list[Any]:
    return list(tree) if isinstance(tree, tuple | list) else [tree]


def _split_axes(mappings: Sequence[Factors], shaped: Sequence[Any], split: frozenset[str]) -> dict[str, Any]:
    """Split factor -> the mesh axes the first of ``shaped`` (arrays with shardings, one per mapping) to split
    a dimension it names is split over."""
    axes: dict[str, Any] = {}
    for m, x in zip(mappings, shaped, strict=True):
        spec = tuple(getattr(x.sharding, "spec", ())) + (None,) * len(m)
        for e, a in zip(m, spec, strict=False):
            if e in split and a is not None:
                axes.setdefault(e, a)
    return axes


def _shardings(mesh: Any, mappings: Sequence[Factors], axes: dict[str, Any]) -> list[NamedSharding]:
    return [NamedSharding(mesh, PartitionSpec(*(axes.get(e) for e in m))) for m in mappings]

