"""Kernels that run on each device's shard: ``splittable(fn, rule, split=...)``.

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

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

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


def _per_shard(fn: Callable[..., Any], sharding_rule: str, split: frozenset[str]) -> Callable[..., Any]:
    """``fn`` as a ``custom_partitioning`` call of ``sharding_rule``: run per shard of the ``split`` factors,
    every other factor need-replication."""
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
    keep = tuple(dict.fromkeys(e for e in order if e not in split))  # sorted by first use, as Shardy wants

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> tuple[Any, ...]:
        # operand and result shardings that agree factor by factor, from the results' split factors
        axes = _split_axes(outs, _leaves(result_shape), split)
        res = _shardings(mesh, outs, axes)
        out = tuple(res) if isinstance(result_shape, tuple | list) else res[0]
        return mesh, fn, out, tuple(_shardings(mesh, ins, axes))

    def infer(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        res = _shardings(mesh, outs, _split_axes(ins, arg_shapes, split))
        return tuple(res) if isinstance(result_shape, tuple | list) else res[0]

    wrapped = custom_partitioning(fn)
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

