"""Spec maps: which sharding each traced tensor gets, scope by scope, and the check run before emission.

A ``SpecMap`` names tensors by *scope* and tensor id. A scope is the path from the top-level graph down to a
nested body: ``()`` is the top-level graph, ``((op_id, body_index),)`` is body ``body_index`` of top-level op
``op_id`` (for a scan or remat: body 0; a while: 0 = cond, 1 = body; a cond: one body per branch), and
deeper nesting appends more ``(op_id, body_index)`` pairs, each op id counted inside the body before it::

    specs: SpecMap = {
        (): {x_id: ShardingSpec((("data",), ()))},                     # the top-level graph
        scope_key((scan_op, 0)): {dot_id: ShardingSpec(((), (), ("model",)))},   # inside the scan body
    }

Tensors absent from the map are left to the partitioner. ``ShardingSpec.partial`` is a cost-model notion
only: emission pins ``dims`` and ignores ``partial`` (the partitioner decides when to reduce).

``validate_specs`` checks a map against a graph and a mesh before anything is traced: every scope exists,
every tensor id is a tensor of its scope, every axis is a mesh axis, ranks agree, split dimensions divide
evenly, and the mesh's axes are ``Auto`` (what ``with_sharding_constraint`` needs). Its ``EmitError`` names
the tensor, its shape, the op that makes it and its source line, and what to try.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

import jax
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.errors import AutoshardError
from autoshard.trace.graph import Graph, Scope
from cost_models.spec import ShardingSpec

SpecMap: TypeAlias = dict[Scope, dict[int, ShardingSpec]]


class EmitError(AutoshardError, ValueError):
    """A spec map does not fit the graph or the mesh, or a graph could not be emitted."""


def scope_key(*steps: tuple[int, int] | int) -> Scope:
    """The key of a nested scope: ``scope_key()`` is the top level, ``scope_key((7, 0))`` (or ``scope_key(7,
    0)``) is body 0 of op 7, ``scope_key((7, 0), (3, 1))`` is body 1 of op 3 inside it."""
    flat: list[int] = []
    for s in steps:
        if isinstance(s, tuple):
            if len(s) != 2:
                raise EmitError(f"scope_key: each step is (op_id, body_index), got {s!r}")
            flat.extend(int(x) for x in s)
        else:
            flat.append(int(s))
    if len(flat) % 2:
        raise EmitError(f"scope_key: expected (op_id, body_index) pairs, got {steps!r}")
    return tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))


def normalize_key(key: Any) -> Scope:
    """A scope key as a tuple of ``(op_id, body_index)`` int pairs (keys read from JSON are lists)."""
    try:
        return tuple((int(a), int(b)) for a, b in key)
    except (TypeError, ValueError):
        raise EmitError(
            f"spec map key {key!r} is not a sequence of (op_id, body_index) pairs; build keys with "
            "scope_key((op.id, body_index), ...), and use () for the top-level graph"
        ) from None


def partition_spec(spec: ShardingSpec) -> PartitionSpec:
    """The ``PartitionSpec`` of a spec's ``dims`` (``partial`` is dropped)."""
    return PartitionSpec(*(None if not d else d[0] if len(d) == 1 else tuple(d) for d in spec.dims))


def named_sharding(mesh: jax.sharding.Mesh, spec: ShardingSpec) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(spec))


def describe_scope(graph: Graph, key: Scope) -> str:
    """``"the top-level graph"`` or ``"body 0 of scan (op 12) at gpt.py:140 > ..."``."""
    if not key:
        return "the top-level graph"
    parts = []
    g = graph
    for op_id, b in key:
        op = g.ops[op_id]
        parts.append(f"body {b} of {op.where()}")
        g = op.bodies[b]
    return " > ".join(parts)


def resolve_scope(graph: Graph, key: Scope) -> Graph:
    """The Graph a scope key names; ``EmitError`` if the path does not exist."""
    g = graph
    for depth, step in enumerate(key):
        if not (isinstance(step, tuple) and len(step) == 2):
            raise EmitError(f"spec map key {key!r}: step {depth} is {step!r}, expected (op_id, body_index)")
        op_id, b = step
        if not 0 <= op_id < len(g.ops):
            raise EmitError(
                f"spec map key {key!r}: op {op_id} does not exist in {describe_scope(graph, key[:depth])} "
                f"({len(g.ops)} ops); build keys with scope_key((op.id, body_index), ...)"
            )
        op = g.ops[op_id]
        if not 0 <= b < len(op.bodies):
            raise EmitError(
                f"spec map key {key!r}: {op.where()} has {len(op.bodies)} bodies, not a body {b}; "
                "only scan/while/cond/remat and other ops with sub-jaxprs have bodies"
            )
        g = op.bodies[b]
    return g


def iter_scopes(graph: Graph, key: Scope = ()) -> Iterator[tuple[Scope, Graph]]:
    """Every scope of a graph, the top level first, depth first."""
    yield key, graph
    for op in graph.ops:
        for b, body in enumerate(op.bodies):
            yield from iter_scopes(body, (*key, (op.id, b)))


def _made_by(graph: Graph, tid: int) -> str:
    t = graph.tensors[tid]
    if t.producer is not None:
        return f"made by {graph.ops[t.producer].where()}"
    if tid in graph.inputs:
        return f"input {graph.inputs.index(tid)} of the graph"
    return "a constant"


def _axis_types_ok(mesh: jax.sharding.Mesh) -> list[str]:
    """Names of mesh axes that are not Auto (``with_sharding_constraint`` on a NamedSharding needs Auto)."""
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return []
    auto = getattr(jax.sharding, "AxisType", None)
    if auto is None:
        return []
    return [n for n, t in zip(mesh.axis_names, types, strict=True) if t != auto.Auto]


def spec_problems(
    graph: Graph, key: Scope, tid: Any, spec: Any, mesh_shape: Mapping[str, int]
) -> list[str]:
    """What is wrong with one (tensor id, spec) entry of a scope, as sentences (empty if nothing)."""
    scope = resolve_scope(graph, key)
    where = describe_scope(graph, key)
    if not isinstance(tid, int) or not 0 <= tid < len(scope.tensors):
        return [f"tensor id {tid!r} is not a tensor of {where} ({len(scope.tensors)} tensors)"]
    t = scope.tensors[tid]
    head = f"tensor {t.id} {t.name!r} {t.dtype}{list(t.shape)} ({_made_by(scope, tid)}) in {where}"
    if not isinstance(spec, ShardingSpec):
        return [f"{head}: spec is a {type(spec).__name__}, expected cost_models.ShardingSpec"]
    out = []
    if spec.ndim != len(t.shape):
        out.append(
            f"{head}: spec {spec} has {spec.ndim} dimensions but the tensor has {len(t.shape)}; give one "
            "entry per dimension (R for unsplit)"
        )
        return out
    bad = sorted(a for a in spec.sharded_axes if a not in mesh_shape)
    if bad:
        out.append(
            f"{head}: spec {spec} uses {', '.join(map(repr, bad))}, not an axis of the mesh "
            f"{dict(mesh_shape)}; rename the axis or emit on a mesh that has it"
        )
        return out
    for i, (n, axes) in enumerate(zip(t.shape, spec.dims, strict=True)):
        k = math.prod(mesh_shape[a] for a in axes)
        if n % k:
            out.append(
                f"{head}: dimension {i} of size {n} does not divide into the {k} shards of "
                f"{'×'.join(axes)} in spec {spec}; split another dimension, use a smaller axis, or leave "
                "the tensor unconstrained"
            )
    return out


def validate_specs(graph: Graph, specs: Mapping[Scope, Mapping[int, ShardingSpec]],
                   mesh: jax.sharding.Mesh, *, limit: int = 10) -> None:
    """Raise ``EmitError`` listing (up to ``limit``) every spec that does not fit the graph or the mesh."""
    non_auto = _axis_types_ok(mesh)
    if non_auto:
        raise EmitError(
            f"mesh axes {non_auto} are not Auto; emission pins values with with_sharding_constraint, which "
            "needs Auto axes: build the mesh with jax.sharding.Mesh(devices, names) or "
            "jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * n)"
        )
    mesh_shape = dict(mesh.shape)
    problems: list[str] = []
    for raw, entries in specs.items():
        try:
            key = normalize_key(raw)
            resolve_scope(graph, key)
        except EmitError as e:
            problems.append(str(e))
            continue
        for tid, spec in entries.items():
            problems.extend(spec_problems(graph, key, tid, spec, mesh_shape))
    if problems:
        more = f"\n  ... and {len(problems) - limit} more" if len(problems) > limit else ""
        raise EmitError(
            f"{len(problems)} sharding spec(s) do not fit the graph or the mesh {mesh_shape}:\n  "
            + "\n  ".join(problems[:limit])
            + more
        )
