"""Per-microbatch programs that leave data-parallel partial sums unreduced, so a step reduces them once.

A stage sharded data-parallel inside its submesh computes each weight gradient as a sum over the batch,
and the batch is split: every device holds a partial sum (a ``ShardingSpec`` with ``partial`` axes). Left
to itself, XLA all-reduces it inside the backward program, once per microbatch. Here the program returns
it *stacked* instead (the standard trick): the per-device partial sums of a tensor ``g`` of shape ``s``,
partial over mesh axes ``A`` (``D = Π_{a∈A} |a|``), become one array of shape ``(D, *s)`` whose leading
dimension is split over ``A``, so that ``g = Σ_i stacked[i]`` and no collective is needed. The runtime adds
the stacked values of the ``B`` microbatches elementwise (no communication) and sums the leading dimension
once per step, in the layout the update wants (an all-reduce, or a reduce-scatter for a sharded update).

Which values are stacked (``plan_stacked``, static, from the stage's layouts):

- *producers*: a ``dot_general`` whose contracting dimensions are split over the same axes ``A`` on both
  operands, and a ``reduce_sum`` over dimensions split over ``A``; their result is partial over ``A``.
  They run as a ``jax.shard_map`` over the whole submesh computing the local result, with a new leading
  dimension of size 1 per device (``D`` in all, split over ``A``).
- *linear ops* on stacked values, run under ``jax.vmap`` over the leading dimension: layout ops
  (``transpose``, ``reshape``, ``convert_element_type``, ...), ``reduce_sum``, sums of stacked values with
  the same axes, and products or quotients by an unstacked value (``mul``, ``div``).
- a value stays stacked only if it ends in an accumulated result that no other per-microbatch program
  reads, through ops that keep it stacked; everything else is computed as before (XLA reduces it where
  the op sits). The analysis prunes until no stacked value feeds an op that needs it whole.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.emit.interpret import Interpreter
from autoshard.trace.graph import Graph, Op, Scope
from cost_models import ShardingSpec

Axes = tuple[str, ...]

_LAYOUT = frozenset({"transpose", "reshape", "convert_element_type", "copy", "copy_p", "neg", "squeeze",
                     "expand_dims", "broadcast_in_dim", "reduce_precision", "reduce_sum"})
_SUMS = frozenset({"add", "add_any", "sub"})


def _axes_of(spec: ShardingSpec | None, dim: int) -> Axes | None:
    return None if spec is None or spec.partial else tuple(spec.dims[dim])


def produced_partial(op: Op, graph: Graph, specs: Mapping[int, ShardingSpec]) -> Axes:
    """The mesh axes over which ``op``'s result is a partial sum given its inputs' layouts (``()``: none,
    or not a case handled here)."""
    out = graph.tensors[op.outputs[0]] if len(op.outputs) == 1 else None
    if out is None or not jnp.issubdtype(out.dtype, jnp.inexact):
        return ()
    name = op.primitive
    if name == "dot_general" and len(op.inputs) == 2:
        ls, rs = specs.get(op.inputs[0]), specs.get(op.inputs[1])
        (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
        axes: list[str] = []
        for a, b in zip(lc, rc, strict=True):
            la, ra = _axes_of(ls, a), _axes_of(rs, b)
            if la is None or la != ra:
                return ()
            axes += la
        for a, b in zip(lb, rb, strict=True):
            if _axes_of(ls, a) != _axes_of(rs, b):
                return ()
        free = [x for i in range(len(ls.dims)) if i not in (*lc, *lb) for x in ls.dims[i]]  # type: ignore[union-attr]
        free += [x for i in range(len(rs.dims)) if i not in (*rc, *rb) for x in rs.dims[i]]  # type: ignore[union-attr]
        return tuple(axes) if len(set(free)) == len(free) else ()
    if name == "reduce_sum" and len(op.inputs) == 1:
        xs = specs.get(op.inputs[0])
        if xs is None or xs.partial:
            return ()
        return tuple(a for d in op.eqn.params["axes"] for a in xs.dims[d])
    return ()


def _linear(op: Op, stacked_in: Sequence[bool], axes_in: Sequence[Axes | None]) -> bool:
    """Whether ``op`` may take its stacked inputs (those flagged) stacked and give stacked results."""
    n = sum(stacked_in)
    if not n or len({a for a, s in zip(axes_in, stacked_in, strict=True) if s}) != 1:
        return False
    name = op.primitive
    if name in _LAYOUT:
        return len(op.inputs) == 1
    if name in _SUMS:
        return n == len(op.inputs)
    if name == "mul":
        return n == 1 and len(op.inputs) == 2
    if name == "div":
        return len(op.inputs) == 2 and stacked_in[0] and not stacked_in[1]
    return False


def plan_stacked(graph: Graph, ops: Sequence[Op], specs: Mapping[int, ShardingSpec], keep: Collection[int]
                 ) -> tuple[dict[int, Axes], dict[int, Axes]]:
    """``(stacked, producers)``: the tensors to carry stacked (tensor id -> partial axes, in mesh order of
    first use) and the producer ops that make them (op id -> axes); ``keep``: the program's outputs that
    may leave stacked (see the module docstring)."""
    candidates = {op.id: produced_partial(op, graph, specs) for op in ops}
    candidates = {i: a for i, a in candidates.items() if a}
    inside = {op.id for op in ops}
    banned: set[int] = set()
    while True:
        stacked: dict[int, Axes] = {}
        producers: dict[int, Axes] = {}
        for op in ops:
            if op.id in banned:
                continue
            if op.id in candidates:
                producers[op.id] = stacked[op.outputs[0]] = candidates[op.id]
                continue
            flags = [t in stacked for t in op.inputs]
            inexact = all(jnp.issubdtype(graph.tensors[t].dtype, jnp.inexact) for t in op.outputs)
            if inexact and _linear(op, flags, [stacked.get(t) for t in op.inputs]):
                ax = next(stacked[t] for t in op.inputs if t in stacked)
                for t in op.outputs:
                    stacked[t] = ax
        # a stacked value must only reach ops that keep it stacked, or leave as an accumulated result
        bad = set()
        for t in stacked:
            ten = graph.tensors[t]
            users = [c for c in ten.consumers if c in inside]
            leaves = t in graph.outputs or any(c not in inside for c in ten.consumers)
            if (leaves and t not in keep) or any(not set(graph.ops[c].outputs) <= stacked.keys() for c in users):
                bad.add(ten.producer)
        if not bad:
            return stacked, producers
        banned |= {b for b in bad if b is not None}


def _entry(d: Sequence[str]) -> Any:
    return None if not d else d[0] if len(d) == 1 else tuple(d)


def _pspec(axes: Axes, dims: Sequence[Sequence[str]]) -> PartitionSpec:
    """The layout of a stacked value: leading dimension over ``axes``, then ``dims``."""
    return PartitionSpec(_entry(axes), *(_entry(d) for d in dims))


class UnreducedInterpreter(Interpreter):
    """An ``Interpreter`` for per-microbatch stage programs that returns partial sums stacked (module doc).
    ``stacked`` maps the tensors carried stacked to their partial axes."""

    def __init__(self, mesh: jax.sharding.Mesh, specs: Mapping[Scope, Mapping[int, ShardingSpec]],
                 stacked: Mapping[int, Axes], producers: Mapping[int, Axes],
                 manual: Collection[str] = ()) -> None:
        super().__init__(mesh, specs)
        self.stacked = dict(stacked)
        self.producers = dict(producers)
        self.manual = frozenset(manual)  # axes already manual where it runs (the SPMD pipeline's stage axis)

    def stacked_sharding(self, tid: int) -> NamedSharding:
        """Where a stacked result lives: leading dimension over its partial axes, the rest as planned
        (without those axes)."""
        axes = self.stacked[tid]
        spec = self.specs.get((), {}).get(tid)
        dims = [tuple(a for a in d if a not in axes) for d in spec.dims] if spec is not None else []
        return NamedSharding(self.mesh, _pspec(axes, dims))

    def _eval(self, ops: Sequence[Op], key: Scope, env: dict[int, Any], read: Any) -> None:
        if key != () or not self.stacked:
            return super()._eval(ops, key, env, read)
        scope = self.specs.get((), {})
        for op in ops:
            invals = [read(t, a, op) for t, a in zip(op.inputs, op.eqn.invars, strict=True)]
            if op.id in self.producers:
                outs = [self._local(op, invals, scope)]
            elif any(t in self.stacked for t in op.inputs):
                outs = self._batched(op, invals)
            else:
                outs = self._bind(op, key, invals)
                for tid, x in zip(op.outputs, outs, strict=True):
                    env[tid] = self._pin(x, tid, scope, key)
                continue
            for tid, x in zip(op.outputs, outs, strict=True):
                rest = (PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1)
                env[tid] = jax.lax.with_sharding_constraint(
                    x, NamedSharding(self.mesh, PartitionSpec(_entry(self.stacked[tid]), *rest)))
        return None

    def _local(self, op: Op, invals: list[Any], scope: Mapping[int, ShardingSpec]) -> Any:
        """A producer's local result on every device, stacked: ``(D, *shape)`` split over its axes."""
        axes = self.producers[op.id]
        in_specs = tuple(PartitionSpec(*(_entry(d) for d in scope[t].dims)) for t in op.inputs)
        if op.primitive == "dot_general":
            (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
            ls, rs = scope[op.inputs[0]].dims, scope[op.inputs[1]].dims
            dims = [ls[i] for i in lb] + [ls[i] for i in range(len(ls)) if i not in (*lc, *lb)]
            dims += [rs[i] for i in range(len(rs)) if i not in (*rc, *rb)]
        else:
            xs = scope[op.inputs[0]].dims
            dims = [xs[i] for i in range(len(xs)) if i not in op.eqn.params["axes"]]
        params = dict(op.eqn.params)
        if "out_sharding" in params:
            params["out_sharding"] = None

        def local(*xs: Any) -> Any:
            return op.eqn.primitive.bind(*xs, **params)[None]

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=_pspec(axes, dims),
                           axis_names=set(self.mesh.axis_names) - self.manual, check_vma=False)
        return fn(*invals)

    def _batched(self, op: Op, invals: list[Any]) -> list[Any]:
        """A linear op applied to each stacked slice (``jax.vmap`` over the leading dimension)."""
        axes = tuple(0 if t in self.stacked else None for t in op.inputs)
        params = dict(op.eqn.params)

        def one(*xs: Any) -> Any:
            return op.eqn.primitive.bind(*xs, **params)

        outs = jax.vmap(one, in_axes=axes)(*invals)
        return list(outs) if op.eqn.primitive.multiple_results else [outs]


def stacked_size(mesh: jax.sharding.Mesh, axes: Axes) -> int:
    """``D``: the leading dimension of a value stacked over ``axes``."""
    return math.prod(mesh.shape[a] for a in axes)
