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
  operands, a ``reduce_sum`` over dimensions split over ``A``, and a ``scatter-add`` into zeros (an
  embedding's gradient, below); their result is partial over ``A``. They run as a ``jax.shard_map`` over
  the whole submesh computing the local result, with a new leading dimension of size 1 per device (``D``
  in all, split over ``A``).
- *linear ops* on stacked values, run under ``jax.vmap`` over the leading dimension: layout ops
  (``transpose``, ``reshape``, ``convert_element_type``, ...), ``reduce_sum``, sums of stacked values with
  the same axes, products or quotients by an unstacked value (``mul``, ``div``), and a ``scatter-add`` of
  stacked updates into zeros at unstacked indices.
- a value stays stacked only if it ends in an accumulated result that no other per-microbatch program
  reads, through ops that keep it stacked; everything else is computed as before (XLA reduces it where
  the op sits). The analysis prunes until no stacked value feeds an op that needs it whole.

The scatter-add rule. ``r = scatter_add(z, idx, u) = z + s`` adds the rows of ``u`` at ``idx`` into ``z``.
With ``u`` split over ``A`` along its scatter (window-less) dimensions, ``idx`` split identically (so each
device holds the indices of its rows) and ``z`` not split over ``A``, device ``i``'s local scatter-add is
``z + s_i`` with ``Σ_i s_i = s``: the stack sums to ``D·z + s = r + (D − 1)·z``. That is ``r`` only when
``z = 0``, so the operand must be known zeros (a zero constant, or a ``broadcast_in_dim`` of one), as
``jax.grad`` makes it for a gather's transpose; any other operand is left to XLA. The operand must also be
split only along window dimensions that the updates cover whole and split alike (its indexed and inserted
dimensions whole, so that local indices are the global ones), with no ``operand_batching_dims``; zeros
without a planned layout are taken whole. The result is laid out as the operand. The same zero operand
lets a scatter-add take stacked updates under ``vmap``: each slice gives ``0 + s_i``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.emit.interpret import Interpreter
from autoshard.trace.graph import Graph, Op, Scope
from cost_models import ShardingSpec

Axes = tuple[str, ...]

_LAYOUT = frozenset({"transpose", "reshape", "convert_element_type", "copy", "copy_p", "neg", "squeeze",
                     "expand_dims", "broadcast_in_dim", "reduce_precision", "reduce_sum"})
_SUMS = frozenset({"add", "add_any", "sub"})
_SCATTER_ADD = frozenset({"scatter-add", "scatter_add"})


def _axes_of(spec: ShardingSpec | None, dim: int) -> Axes | None:
    return None if spec is None or spec.partial else tuple(spec.dims[dim])


def produced_partial(op: Op, graph: Graph, specs: Mapping[int, ShardingSpec]) -> Axes:
    """The mesh axes over which ``op``'s result is a partial sum given its inputs' layouts (``()``: none,
    or not a case handled here)."""
    out = graph.tensors[op.outputs[0]] if len(op.outputs) == 1 else None
    if out is None or not out.inexact:
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
    if name in _SCATTER_ADD:
        return _scatter_partial(op, graph, specs)
    return ()


def _zeros(graph: Graph, tid: int) -> bool:
    """Whether tensor ``tid`` is known to be all zeros: a zero constant, or a ``broadcast_in_dim`` of one."""
    producer = graph.tensors[tid].producer
    if producer is None:
        value = graph.constants.get(tid)
        return value is not None and not np.any(np.asarray(value) != 0)
    op = graph.ops[producer]
    return op.primitive == "broadcast_in_dim" and len(op.inputs) == 1 and _zeros(graph, op.inputs[0])


def _whole(shape: Sequence[int]) -> ShardingSpec:
    return ShardingSpec(dims=((),) * len(shape))


def _scatter_partial(op: Op, graph: Graph, specs: Mapping[int, ShardingSpec]) -> Axes:
    """The axes ``A`` over which a scatter-add into zeros is partial (the module docstring's rule), or ``()``."""
    if len(op.inputs) != 3 or not _zeros(graph, op.inputs[0]):
        return ()
    zs, xs, us = (specs.get(t) for t in op.inputs)
    if xs is None or us is None or xs.partial or us.partial or (zs is not None and zs.partial):
        return ()
    zs = zs if zs is not None else _whole(graph.tensors[op.inputs[0]].shape)
    dn = op.eqn.params["dimension_numbers"]
    if dn.operand_batching_dims or dn.scatter_indices_batching_dims:
        return ()
    z_shape, u_shape = graph.tensors[op.inputs[0]].shape, graph.tensors[op.inputs[2]].shape
    window = tuple(dn.update_window_dims)
    rows = [d for d in range(len(u_shape)) if d not in window]
    # the indices: the updates' scatter dimensions, split alike, then the index vector, whole
    if len(xs.dims) != len(rows) + 1 or xs.dims[-1] or any(
            tuple(xs.dims[k]) != tuple(us.dims[d]) for k, d in enumerate(rows)):
        return ()
    axes = tuple(a for d in rows for a in us.dims[d])
    # the operand: split only along window dimensions that the updates cover whole and split alike
    covered = [d for d in range(len(z_shape)) if d not in dn.inserted_window_dims]
    if len(covered) != len(window):
        return ()
    for w, d in zip(window, covered, strict=True):
        if tuple(us.dims[w]) != tuple(zs.dims[d]):
            return ()
        if zs.dims[d] and (d in dn.scatter_dims_to_operand_dims or u_shape[w] != z_shape[d]):
            return ()
    if any(zs.dims[d] for d in dn.inserted_window_dims):
        return ()
    if set(axes) & {a for d in zs.dims for a in d}:
        return ()
    return axes


def _linear(op: Op, graph: Graph, stacked_in: Sequence[bool], axes_in: Sequence[Axes | None]) -> bool:
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
    if name in _SCATTER_ADD:  # stacked updates into zeros: the slices sum to the scatter of their sum
        return tuple(stacked_in) == (False, False, True) and _zeros(graph, op.inputs[0])
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
            inexact = all(graph.tensors[t].inexact for t in op.outputs)
            if inexact and _linear(op, graph, flags, [stacked.get(t) for t in op.inputs]):
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
        layouts = [scope.get(t) for t in op.inputs]
        if op.primitive in _SCATTER_ADD and layouts[0] is None:  # zeros with no planned layout: whole
            layouts[0] = _whole(op.eqn.invars[0].aval.shape)
        in_specs = tuple(PartitionSpec(*(_entry(d) for d in x.dims)) for x in layouts)  # type: ignore[union-attr]
        if op.primitive == "dot_general":
            (lc, rc), (lb, rb) = op.eqn.params["dimension_numbers"]
            ls, rs = scope[op.inputs[0]].dims, scope[op.inputs[1]].dims
            dims = [ls[i] for i in lb] + [ls[i] for i in range(len(ls)) if i not in (*lc, *lb)]
            dims += [rs[i] for i in range(len(rs)) if i not in (*rc, *rb)]
        elif op.primitive in _SCATTER_ADD:  # laid out as its operand, zeros (``_scatter_partial``)
            dims = list(layouts[0].dims)  # type: ignore[union-attr]
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
