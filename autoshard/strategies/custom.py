"""Rules for ops the planner cannot see into: ``shard_map`` regions, ``custom_partitioning`` calls, custom
kernels (``pallas_call``, ``ffi_call``) and ``reshard``.

- ``shard_map``: the region's ``in_specs`` and ``out_specs`` are fixed layouts. One candidate: operands
  arrive in the in_specs' layout (the edges into the region price the resharding), results leave in the
  out_specs' layout. Its mesh axes are the plan's axes *by name*: a region is written for a mesh (its body
  was traced at per-shard shapes on that mesh, its collectives name the axes), so its mesh must be the
  plan's, with the same axis names, sizes and order; otherwise planning stops with a ``PlanningError``
  naming the region, its mesh and the plan's, and what to pass instead. (Mapping axes by position would
  rename the axes the body's collectives use; emitting a region written over some of the axes fails in
  jax on a mesh with more.) Emission binds the region as the user wrote it, moved onto the device mesh
  (``jaxpr_compat.region_on_mesh``: the same axes, possibly other devices or axis types). The tracer
  counts a region's flops as its body's, which is what each device runs, so the candidate's work is not
  divided again; the collectives its body runs (``psum``, ``all_gather``, ...) are priced as the op's own.
- ``custom_partitioning``: read the Shardy ``sharding_rule`` (``"i j, j k -> i k"``, or an
  ``SdyShardingRule``) as *factors*: a factor names dimensions of operands and results that are split
  alike. A factor in some result may be split over mesh axes (unless declared ``need_replication`` or
  ``permutation``); a declared ``reduction`` factor may be split too, and then the op all-reduces its
  results over those axes (the partition callback's ``psum``); any other factor stays whole. Compound
  factors (``(a b)``) stay whole. A call with no rule, or a rule given as a callable (it needs the lowering's
  mesh and MLIR types), is replicated with a warning.
- custom kernels: ``register_rule(name, "b h q d, b h k d, b h k d -> b h q d", split=("b", "h"),
  flops=...)`` declares, in the same notation, which factors a kernel may be split along and what it
  computes. ``name`` is a ``pallas_call``'s kernel name (its ``name=``, else the kernel function's name),
  an ``ffi_call``'s target name, or a primitive name. Unregistered kernels are replicated with a warning
  that says how to register one. Emission binds the kernel as traced, on the planned layouts: XLA
  partitions what it can (a Pallas kernel in ``interpret=True`` mode is ordinary HLO); a compiled kernel
  is an opaque custom call, which XLA runs whole on each device after gathering its operands, unless the
  call is wrapped in ``autoshard.splittable`` (a ``custom_partitioning`` call, above).
- ``reshard``: on a mesh whose axes are all Auto it is a type-level no-op (it lowers to its operand);
  ``grad`` seeds it on literals when a step is traced with arguments already placed on a mesh (a
  ``parallelize`` step's second call, fed the first call's results). It takes any layout, as a copy does.
  Splitting dimensions over Explicit axes it fixes those dimensions' layout (named as in the plan), as
  ``jax.sharding.reshard`` does under explicit sharding.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from autoshard.strategies.registry import (
    RULES,
    Candidate,
    RuleContext,
    assignments,
    enumerate_specs,
    register,
)
from autoshard.target import PlanningError
from autoshard.trace import costs, unruled
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace.graph import Graph, Op
from cost_models import ShardingSpec

Shape = tuple[int, ...]
Entry = str | tuple[str, ...]  # a factor, "…g" (leading batching dimensions of group g), or a compound factor
FactorMapping = tuple[Entry, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class FactorRule:
    """A sharding rule in factors: per operand and per result, the entry of each dimension; the factors
    that may be split over mesh axes (``split``), and those of them that the op sums over (``reduce``: absent
    from every result, a split one leaves partial sums that the op all-reduces)."""

    operands: tuple[FactorMapping, ...]
    results: tuple[FactorMapping, ...]
    split: frozenset[str]
    reduce: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True, slots=True)
class KernelRule:
    """What ``register_rule`` records for one kernel."""

    name: str
    rule: FactorRule
    flops: float | Callable[[list[Shape], list[Shape]], float] | None


KERNELS: dict[str, KernelRule] = {}
"""Registered kernels by name (``register_rule``); like ``RULES``, filled at import and by users."""

CUSTOM_CALLS = ("pallas_call", "ffi_call")
"""Primitives whose ops are named by the kernel they run (``costs.custom_call_name``)."""


# ---- the notation -------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\(([^()]*)\)|(\.\.\.|…)(\d*)|([A-Za-z][A-Za-z0-9_]*)|(\S)")


def _mapping(text: str, where: str) -> FactorMapping:
    out: list[Entry] = []
    for m in _TOKEN.finditer(text):
        compound, dots, group, factor, bad = m.groups()
        if bad is not None:
            raise ValueError(f"{where}: unexpected {bad!r} in {text.strip()!r}; factors are names such as 'b' or "
                             "'heads', separated by spaces")
        if compound is not None:
            parts = tuple(compound.split())
            if len(parts) < 2:
                raise ValueError(f"{where}: a compound factor '({compound})' needs two factors or more")
            out.append(parts)
        elif dots is not None:
            if out:
                raise ValueError(f"{where}: '...' may only open an operand or a result, in {text.strip()!r}")
            out.append("…" + (group or "0"))
        else:
            out.append(factor)
    return tuple(out)


def parse_rule(text: str) -> tuple[tuple[FactorMapping, ...], tuple[FactorMapping, ...]]:
    """``"b h q d, b h k d -> b h q d"`` -> (operand mappings, result mappings): one entry per dimension,
    a factor name, ``"…g"`` for leading batching dimensions (``...``), or a tuple for a compound ``(a b)``."""
    if text.count("->") != 1:
        raise ValueError(f"sharding rule {text!r}: expected 'operands -> results', e.g. 'i j, j k -> i k'")
    lhs, rhs = text.split("->")
    ins = tuple(_mapping(s, f"operand {k} of {text!r}") for k, s in enumerate(lhs.split(",")))
    outs = tuple(_mapping(s, f"result {k} of {text!r}") for k, s in enumerate(rhs.split(",")))
    return ins, outs


def _factors(mappings: Iterable[FactorMapping]) -> set[str]:
    return {e for m in mappings for e in m if isinstance(e, str) and not e.startswith("…")}


def _resolve(mapping: FactorMapping, rank: int) -> tuple[str | None, ...] | None:
    """The factor of each of ``rank`` dimensions (None: a dimension no single factor names, which stays
    whole), or None when the mapping cannot describe an array of that rank. Batching dimensions are
    numbered from the right, so that operands with more of them line up as in NumPy broadcasting."""
    if mapping and isinstance(mapping[0], str) and mapping[0].startswith("…"):
        n = rank - (len(mapping) - 1)
        if n < 0:
            return None
        lead: list[str | None] = [f"{mapping[0]}.{n - 1 - i}" for i in range(n)]
        rest = mapping[1:]
    elif len(mapping) != rank:
        return None
    else:
        lead, rest = [], mapping
    return tuple(lead + [e if isinstance(e, str) else None for e in rest])


# ---- candidates from factors --------------------------------------------------------------------------


def factor_candidates(op: Op, ctx: RuleContext, rule: FactorRule) -> list[Candidate] | str:
    """Every way to give mesh axes to the splittable factors of ``rule`` (each axis to one factor at most,
    each split dividing its factor's size); or, when the rule does not fit the op, a sentence saying why.
    Operands before those the rule describes (a kernel's scalar-prefetch operands) are replicated."""
    ins, outs = ctx.in_shapes(op), ctx.out_shapes(op)
    if len(ins) < len(rule.operands) or len(outs) != len(rule.results):
        return (f"the rule describes {len(rule.operands)} operand(s) and {len(rule.results)} result(s), the op "
                f"has {len(ins)} and {len(outs)}")
    lead = len(ins) - len(rule.operands)
    arrays = [(m, s) for m, s in zip(rule.operands, ins[lead:], strict=True)]
    arrays += list(zip(rule.results, outs, strict=True))
    dims: list[tuple[str | None, ...]] = []
    for k, (m, shape) in enumerate(arrays):
        d = _resolve(m, len(shape))
        if d is None:
            what = f"operand {k}" if k < len(rule.operands) else f"result {k - len(rule.operands)}"
            return f"{what} has shape {list(shape)}, which its {len(m)} factor(s) {' '.join(map(str, m))} cannot name"
        dims.append(d)
    sizes: dict[str, set[int]] = {}
    repeated: set[str] = set()
    for d, (_, shape) in zip(dims, arrays, strict=True):
        named = [f for f in d if f is not None]
        repeated |= {f for f in named if named.count(f) > 1}
        for f, n in zip(d, shape, strict=True):
            if f is not None:
                sizes.setdefault(f, set()).add(n)
    batching = {f for f in sizes if f.startswith("…") and f.split(".")[0] in rule.split}
    free = [f for f in sizes if (f in rule.split or f in batching) and f not in repeated
            and len(sizes[f]) == 1 and next(iter(sizes[f])) > 1]
    cands = []
    for slots in assignments([next(iter(sizes[f])) for f in free], ctx):
        axes_of = {f: a for f, a in zip(free, slots, strict=True) if a}
        specs = [ShardingSpec(dims=tuple(axes_of.get(f, ()) if f is not None else () for f in d)) for d in dims]
        in_specs = tuple(ShardingSpec.replicated(len(s)) for s in ins[:lead]) + tuple(specs[:len(rule.operands)])
        out_specs = tuple(specs[len(rule.operands):])
        summed = {axis for f, axes in axes_of.items() if f in rule.reduce for axis in axes}
        comm = ()
        if summed:
            axes = tuple(a for a in ctx.mesh.axis_names if a in summed)
            comm = tuple(("all_reduce", axes, ctx.graph.tensors[t].nbytes / max(1, s.num_shards(ctx.mesh)))
                         for t, s in zip(op.outputs, out_specs, strict=True))
        work = frozenset(axis for axes in axes_of.values() for axis in axes)
        cands.append(Candidate(in_specs, out_specs, comm=comm, work_axes=work))
    return cands


def _warn(op: Op, what: str, why: str, hint: str) -> None:
    """One warning per ``what`` (a primitive, or a primitive's kernel) per process (``trace.unruled``)."""
    unruled.warn_once(what, "%s (first seen at %s): %s; its operands and results are replicated. %s",
                      what, op.source or "an unknown location", why, hint)


def _candidates_or_warn(op: Op, ctx: RuleContext, rule: FactorRule, what: str, hint: str) -> list[Candidate]:
    got = factor_candidates(op, ctx, rule)
    if isinstance(got, str):
        _warn(op, what, f"its sharding rule does not fit the op: {got}", hint)
        return []
    return got


# ---- custom_partitioning --------------------------------------------------------------------------------


def sdy_rule(rule: Any) -> FactorRule:
    """A ``FactorRule`` from Shardy's ``SdyShardingRule`` (what ``custom_partitioning`` keeps, having parsed
    a string rule). Factor kinds as in Shardy: a factor in a result is pass-through (splittable) unless
    declared need-replication or permutation; a reduction factor is splittable and summed."""
    ins = tuple(tuple(e if isinstance(e, str) else tuple(e) for e in m) for m in rule.operand_mappings)
    outs = tuple(tuple(e if isinstance(e, str) else tuple(e) for e in m) for m in rule.result_mappings)
    keep = set(getattr(rule, "need_replication_factors", ())) | set(getattr(rule, "permutation_factors", ()))
    reduce = frozenset(getattr(rule, "reduction_factors", ())) - keep
    passing = _factors(outs) - keep
    batching = {e for m in (*ins, *outs) for e in m[:1] if isinstance(e, str) and e.startswith("…")}
    return FactorRule(ins, outs, frozenset(passing | reduce | batching), reduce)


@register("custom_partitioning")
def custom_partitioning(op: Op, ctx: RuleContext) -> list[Candidate]:
    rule = op.eqn.params.get("sharding_rule")
    hint = ("Give def_partition a sharding_rule string (Shardy's einsum-like notation, e.g. "
            "sharding_rule='i j, j k -> i k').")
    if rule is None or not hasattr(rule, "operand_mappings"):
        why = "its sharding_rule is a callable, which needs the lowering's mesh" if callable(rule) else \
            "it has no sharding_rule"
        _warn(op, op.primitive, why, hint)
        return []
    factors = sdy_rule(rule)
    cands = _candidates_or_warn(op, ctx, factors, op.primitive, hint)
    ring = getattr(op.eqn.params.get("partition"), "autoshard_ring", None)
    if ring is None:
        return cands
    return [c for c in (_ring(op, ctx, factors, ring, c) for c in cands) if c is not None]


def _ring(op: Op, ctx: RuleContext, rule: FactorRule, ring: Any, cand: Candidate) -> Candidate | None:
    """A ``ring_attention`` call's candidate priced as it runs (``autoshard.ring``): split along its sequence
    factor over ``n`` devices, each computes ``ring.work_share(n)`` of the traced flops; a causal ring
    permutes every operand and result along the sequence into the zig-zag order and back (two half shards
    sent each, exposed); the travelling operands go ``n - 1`` hops and the travelling results ``n`` (their
    last one exposed), one send a hop, beside the blocks. None when a causal ring's sequence does not split
    into ``2n`` chunks."""
    lead = len(op.inputs) - len(rule.operands)
    arrays = [(m, t, s) for m, t, s in zip(rule.operands, op.inputs[lead:], cand.in_specs[lead:], strict=True)]
    arrays += list(zip(rule.results, op.outputs, cand.out_specs, strict=True))
    m, t, spec = arrays[0]
    dim = m.index(ring.factor)
    axes = tuple(a for a in ctx.mesh.axis_names if a in spec.dims[dim])
    n = ctx.size(axes)
    if n == 1:
        return cand
    if ring.causal and ctx.shape(t)[dim] % (2 * n):
        return None

    def shard(tid: int, s: ShardingSpec) -> float:
        return ctx.graph.tensors[tid].nbytes / max(1, s.num_shards(ctx.mesh))

    # two sends of half a shard each way per array (``ring._to_zigzag``); one send a hop per travelling array
    comm = [("send_recv", axes, shard(t, s) / 2) for m, t, s in arrays if ring.factor in m and ring.causal
            for _ in range(2)]
    travelling = [arrays[k] for k in ring.travel] + [arrays[len(rule.operands) + k] for k in ring.back]
    hidden = [("send_recv", axes, shard(t, s)) for _, t, s in travelling for _ in range(n - 1)]
    comm += [("send_recv", axes, shard(t, s)) for _, t, s in travelling[len(ring.travel):]]  # the last hop home
    return dataclasses.replace(cand, comm=cand.comm + tuple(comm), hidden=tuple(hidden),
                               work_scale=ring.work_share(n) * n)


# ---- custom kernels ---------------------------------------------------------------------------------------


def register_rule(name: str, sharding_rule: str, *, split: Iterable[str],
                  flops: float | Callable[[list[Shape], list[Shape]], float] | None = None,
                  matmul: bool = False) -> None:
    """Tell the planner how a custom kernel may be split and what it costs.

    ``name``: a Pallas kernel's name (``pl.pallas_call(..., name=...)``, else the kernel function's
    ``__name__``), an ``ffi_call`` target name, or a primitive's name. ``sharding_rule``: one factor per
    dimension of each operand and each result, in Shardy's notation (``"b h q d, b h k d, b h k d -> b h q
    d"``; ``...`` opens leading batch dimensions). ``split``: the factors the kernel may be split along
    (batch, heads: dimensions its work is independent over); each must name a dimension of a result, and
    every other factor stays whole. ``flops``: a number, or a function of the operand shapes and the
    result shapes; without it a Pallas kernel's ``cost_estimate`` is used, else 0. ``matmul``: the flops are
    matrix products (attention, a fused matmul): they are priced at the matmul units' rate in the operands'
    dtype (tensor cores, the MXU) and count as model flops in the predicted MFU; otherwise at the vector
    rate, as elementwise work.

    Registering a name again replaces its rule. The rule applies to every op of that name, in every step
    planned afterwards in this process."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_rule: name must be a kernel or primitive name, got {name!r}")
    ins, outs = parse_rule(sharding_rule)
    split = frozenset(_mapping(f, f"split of register_rule({name!r})")[0] if "." in f or "…" in f else f
                      for f in split)  # "..." -> "…0", as in the rule
    unknown = sorted(split - _factors((*ins, *outs)) - {e for m in (*ins, *outs) for e in m if
                                                         isinstance(e, str) and e.startswith("…")})
    if unknown:
        raise ValueError(f"register_rule({name!r}): split names {unknown}, which the rule {sharding_rule!r} "
                         "does not use")
    summed = sorted(f for f in split if not f.startswith("…") and f not in _factors(outs))
    if summed:
        raise ValueError(
            f"register_rule({name!r}): {summed} name(s) no result dimension in {sharding_rule!r}; a kernel is "
            "split only along dimensions of its results (a split contraction would leave partial sums that "
            "nothing reduces). Leave them out of split")
    if flops is not None and not callable(flops) and not isinstance(flops, int | float):
        raise ValueError(f"register_rule({name!r}): flops must be a number or a function of (operand shapes, "
                         f"result shapes), got {type(flops).__name__}")
    if name in RULES and RULES[name] is not kernel:
        raise ValueError(f"register_rule({name!r}): {name} is a primitive with a built-in sharding rule")
    KERNELS[name] = KernelRule(name, FactorRule(ins, outs, split), flops)
    costs.KERNEL_FLOPS[name] = flops
    if matmul:
        costs.MATMUL_KERNELS.add(name)
    else:
        costs.MATMUL_KERNELS.discard(name)
    RULES.setdefault(name, kernel)
    costs.FLOP_RULES.setdefault(name, costs.kernel_flop_rule(name))


def forget_rule(name: str) -> None:
    """Undo ``register_rule(name, ...)`` (for tests)."""
    KERNELS.pop(name, None)
    costs.KERNEL_FLOPS.pop(name, None)
    costs.MATMUL_KERNELS.discard(name)
    if name not in CUSTOM_CALLS and RULES.get(name) is kernel:
        del RULES[name]
        costs.FLOP_RULES.pop(name, None)


def kernel(op: Op, ctx: RuleContext) -> list[Candidate]:
    """A custom kernel's candidates, from the rule registered for its name (else for its primitive)."""
    name = costs.custom_call_name(op.primitive, op.eqn.params)
    found = KERNELS.get(name) or KERNELS.get(op.primitive)
    what = f"{op.primitive} kernel {name!r}" if name != op.primitive else f"primitive {op.primitive!r}"
    shapes = ", ".join(str(list(s)) for s in ctx.in_shapes(op))
    results = ", ".join(str(list(s)) for s in ctx.out_shapes(op))
    hint = (f"Register one with autoshard.register_rule({name!r}, sharding_rule, split=..., flops=...), naming "
            f"a factor for each dimension of its operands {shapes} and results {results} (see the README's "
            "'Custom kernels').")
    if found is None:
        _warn(op, what, "no sharding rule is registered for it", hint)
        return []
    return _candidates_or_warn(op, ctx, found.rule, what, hint)


for _p in CUSTOM_CALLS:
    register(_p)(kernel)


# ---- shard_map ----------------------------------------------------------------------------------------


def _mesh_text(names: Sequence[str], sizes: Sequence[int]) -> str:
    return "{" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes, strict=True)) + "}"


@register("shard_map")
def shard_map(op: Op, ctx: RuleContext) -> list[Candidate]:
    """One candidate: the region's in_specs and out_specs, on the plan's axes of the same names."""
    r = jc.region_layout(op.eqn)
    plan = dict(zip(ctx.mesh.axis_names, ctx.mesh.shape, strict=True))
    if (r.names, r.sizes) != (tuple(ctx.mesh.axis_names), tuple(ctx.mesh.shape)):
        region = _mesh_text(r.names, r.sizes)
        raise PlanningError(
            f"{op.where()} is a shard_map written for the mesh {region}, but the plan's mesh is "
            f"{_mesh_text(ctx.mesh.axis_names, ctx.mesh.shape)}. A shard_map's body is traced per shard on its "
            "mesh and its collectives name that mesh's axes, so it runs only on a mesh with the same axes, in "
            f"the same order and of the same sizes: plan on mesh={region} (parallelize also takes the jax Mesh "
            "itself, whose axis names it keeps), or write the shard_map over the mesh you plan for")

    def spec(dims: tuple[tuple[str, ...], ...]) -> ShardingSpec:
        return ShardingSpec(dims=dims)

    work = frozenset()  # the op's flops are one device's (its body's): nothing left to divide
    comm = tuple(_collectives(op.bodies[0], plan)) if op.bodies else ()
    return [Candidate(tuple(spec(d) for d in r.in_dims), tuple(spec(d) for d in r.out_dims), comm=comm,
                      work_axes=work)]


def _collectives(body: Graph, plan: dict[str, int], times: int = 1) -> list[tuple[str, tuple[str, ...], float]]:
    """The collectives a region's body runs, as (kind, axes, bytes per device: the larger buffer). A loop's
    are counted with its trip count's worth of bytes (its latency once)."""
    out = []
    for op in body.ops:
        kind = costs.COLLECTIVES.get(op.primitive)
        if kind is not None:
            p = op.eqn.params
            names = p.get("axes", p.get("axis_name", ()))
            names = (names,) if isinstance(names, str) else tuple(names)
            axes = tuple(str(a) for a in names if isinstance(a, str) and plan.get(a, 1) > 1)
            nbytes = max((body.tensors[t].nbytes for t in (*op.inputs, *op.outputs)), default=0)
            if axes and nbytes:
                out.append((kind, axes, float(nbytes * times)))
        for b in op.bodies:
            out += _collectives(b, plan, times * (op.trip_count or 1))
    return out


# ---- reshard ----------------------------------------------------------------------------------------------


def _explicit_dims(op: Op) -> tuple[tuple[tuple[str, ...], ...], dict[str, int]] | None:
    """The Explicit mesh axes a ``reshard`` puts on each dimension, and those axes' sizes; None when its
    sharding names no Explicit axis (on Auto axes it is a no-op)."""
    dst = op.eqn.params.get("dst_sharding")
    mesh, spec = getattr(dst, "mesh", None), getattr(dst, "spec", None)
    types = getattr(mesh, "axis_types", None)
    if mesh is None or spec is None or types is None:
        return None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    explicit = {str(n): int(sizes[n]) for n, t in zip(mesh.axis_names, types, strict=True) if "Explicit" in str(t)}
    rank = len(op.eqn.outvars[0].aval.shape)
    dims = tuple(tuple(a for a in d if a in explicit) for d in jc.spec_dims(spec, rank))
    return (dims, explicit) if any(dims) else None


@register("reshard")
def reshard(op: Op, ctx: RuleContext) -> list[Candidate]:
    """Auto axes: any layout, as a copy. Explicit axes: the layouts that put exactly those axes on the
    dimensions the sharding names them on (Auto axes free); the operand arrives in that layout."""
    (shape,) = ctx.out_shapes(op)
    found = _explicit_dims(op)
    if found is None:
        return [Candidate((s,), (s,)) for s in enumerate_specs(shape, ctx)]
    fixed, explicit = found
    plan = dict(zip(ctx.mesh.axis_names, ctx.mesh.shape, strict=True))
    bad = sorted(a for d in fixed for a in d if plan.get(a) != explicit[a])
    if bad:
        theirs = _mesh_text(list(explicit), list(explicit.values()))
        ours = _mesh_text(ctx.mesh.axis_names, ctx.mesh.shape)
        raise PlanningError(
            f"{op.where()} reshards over the Explicit mesh axes {bad} of {theirs}, which the plan's mesh {ours} "
            "does not have with those sizes: plan on the mesh the step's explicit shardings name")
    out = [Candidate((s,), (s,)) for s in enumerate_specs(shape, ctx)
           if all(tuple(a for a in d if a in explicit) == f for d, f in zip(s.dims, fixed, strict=True))]
    return out or [Candidate((ShardingSpec(dims=fixed),), (ShardingSpec(dims=fixed),))]
