"""Sharding strategies per op: a registry of rules keyed by primitive.

A *rule* looks at one op (shapes, params) and the mesh and proposes ``Candidate``s: the specs the op needs
on its inputs and produces on its outputs, the collectives the op itself must run (e.g. the all-reduce of
a ``reduce_max`` over a split dimension), and which mesh axes divide its work. ``strategies_for`` prices
each candidate with the cost model and returns ``Strategy`` objects. Resharding *between* ops is not a
rule's business: the problem builder prices it on the edges.

Primitives without a rule get one strategy, everything replicated. For those in ``FALLBACK`` that is
deliberate (logged at debug level); any other primitive gets a warning naming it and its source line, once
per process (``autoshard.trace.unruled``). A test checks that every primitive the examples produce, under
the installed jax, has a rule, is in ``FALLBACK`` or is control flow (planned by the problem builder).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from autoshard.trace import costs, unruled
from autoshard.trace.buffers import dead_ops
from autoshard.trace.costs import CALLBACKS, ELEMENTWISE, REDUCTIONS
from autoshard.trace.graph import Graph, Op
from cost_models import CollectiveStep, CostModel, LogicalMesh, ShardingSpec

log = logging.getLogger("autoshard")


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """What a rule proposes. ``work_axes``: mesh axes that split the op's work (default: every axis its
    first output uses, partial axes included). ``comm``: collectives run inside the op, as
    (kind, axes, nbytes per device in the collectives' convention)."""

    in_specs: tuple[ShardingSpec, ...]
    out_specs: tuple[ShardingSpec, ...]
    comm: tuple[tuple[str, tuple[str, ...], float], ...] = ()
    work_axes: frozenset[str] | None = None
    hidden: tuple[tuple[str, tuple[str, ...], float], ...] = ()
    """Collectives the op runs beside its compute (a ring's sends, each independent of the block computed
    at the same time): only what outlasts the compute is paid."""
    work_scale: float = 1.0
    """The share of the op's flops each device computes, times the work axes' size (1: split evenly)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an op on the mesh, priced: seconds of compute and of in-op collectives."""

    in_specs: tuple[ShardingSpec, ...]
    out_specs: tuple[ShardingSpec, ...]
    compute_time: float
    comm_time: float
    comm: tuple[CollectiveStep, ...] = ()

    @property
    def time(self) -> float:
        return self.compute_time + self.comm_time

    def __str__(self) -> str:
        ins = ", ".join(map(str, self.in_specs))
        outs = ", ".join(map(str, self.out_specs))
        return f"({ins}) -> ({outs})"


@dataclasses.dataclass(frozen=True, slots=True)
class RuleContext:
    """What a rule may look at besides the op."""

    graph: Graph
    mesh: LogicalMesh
    fused: frozenset[int] = frozenset()
    """Tensors that XLA keeps in registers inside a loop fusion (see ``fused_tensors``): no HBM traffic."""
    dead: frozenset[int] = frozenset()
    """Ops that XLA removes, nothing reading their results (``trace.buffers.dead_ops``): priced at zero."""
    results: frozenset[int] | None = None
    """The graph's outputs as a set (``of`` fills it; ``fanout`` asks it for every op)."""
    copies: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """op id -> how many kernels compute a fused op (``fusion_kernels``), each reading its operands from
    memory; ops not listed run in one."""

    @classmethod
    def of(cls, graph: Graph, mesh: LogicalMesh) -> RuleContext:
        memo = graph.memo("autoshard.strategies.kernels")  # derived from the graph alone: once per graph
        if not memo:
            dead = dead_ops(graph)
            memo["dead"] = dead
            memo["fused"], memo["copies"] = fusion_kernels(graph, fused_tensors(graph), dead)
        return cls(graph, mesh, memo["fused"], memo["dead"], frozenset(graph.outputs), memo["copies"])

    def shape(self, tid: int) -> tuple[int, ...]:
        return self.graph.tensors[tid].shape

    def in_shapes(self, op: Op) -> list[tuple[int, ...]]:
        return [self.graph.tensors[t].shape for t in op.inputs]

    def out_shapes(self, op: Op) -> list[tuple[int, ...]]:
        return [self.graph.tensors[t].shape for t in op.outputs]

    def fanout(self, tid: int) -> int:
        results = self.graph.outputs if self.results is None else self.results
        return len(self.graph.tensors[tid].consumers) + (1 if tid in results else 0)

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axes worth splitting over (size > 1)."""
        return tuple(a for a, s in zip(self.mesh.axis_names, self.mesh.shape, strict=True) if s > 1)

    def size(self, axes: Iterable[str]) -> int:
        return math.prod(self.mesh.axis_size(a) for a in axes)


Rule = Callable[[Op, RuleContext], list[Candidate]]
RULES: dict[str, Rule] = {}

FALLBACK: frozenset[str] = frozenset({
    # PRNG plumbing on keys: tiny (a key is two words), and splitting it would change the random stream.
    "random_bits", "random_wrap", "random_unwrap", "random_seed", "random_fold_in", "random_split", "random_clone",
    "threefry2x32",
    # host callbacks (jax.debug.print, jax.debug.callback, io/pure_callback) see whole values on the host
    *CALLBACKS,
})
"""Primitives replicated on purpose: no rule, and no warning when they fall back."""


def register(*primitives: str) -> Callable[[Rule], Rule]:
    def deco(rule: Rule) -> Rule:
        for p in primitives:
            RULES[p] = rule
        return rule

    return deco


# ---- spec enumeration ---------------------------------------------------------------------------------


def assignments(
    sizes: Sequence[int], ctx: RuleContext, *, max_axes_per_dim: int = 2
) -> list[tuple[tuple[str, ...], ...]]:
    """Every way to give each mesh axis (size > 1) to at most one of ``len(sizes)`` slots (or to none) such
    that each slot's size is divisible by the product of its axes. Axes within a slot keep mesh order
    (major to minor). Returns, per assignment, the axes of each slot."""
    axes = ctx.axes
    out: list[tuple[tuple[str, ...], ...]] = []
    n = len(sizes)
    for choice in itertools.product(range(-1, n), repeat=len(axes)):
        slots: list[list[str]] = [[] for _ in range(n)]
        for a, c in zip(axes, choice, strict=True):
            if c >= 0:
                slots[c].append(a)
        ok = True
        for s, size in zip(slots, sizes, strict=True):
            if len(s) > max_axes_per_dim or (s and size % ctx.size(s)):
                ok = False
                break
        if ok:
            out.append(tuple(tuple(s) for s in slots))
    return out


def settle_partial(op: Op, ctx: RuleContext, in_specs: tuple[ShardingSpec, ...], out: ShardingSpec,
                   work_axes: frozenset[str] | None = None, *, pending: bool = True) -> list[Candidate]:
    """Candidates for an op whose one output is a partial sum over ``out.partial`` (a matmul's contracting
    split, a reduction over a split dimension, a linear op passing a pending sum on).

    With at most one reader the sum stays pending: the edge to the reader pays the reduction its layout
    asks for (all-reduce to replicate, reduce-scatter to split), or a linear reader passes it on. With
    several readers each edge would pay that reduction again, where the compiled program reduces once and
    shares the result (an Adam gradient is read by both moments' updates). So the op reduces its output
    itself, once: an all-reduce to ``out.dims``, or a reduce-scatter that also splits one more output
    dimension over the partial axes (ZeRO-2's sharded gradient, sequence parallel's activations), one
    candidate per dimension they divide. With ``pending`` (not for matmuls, which always reduced a shared
    sum themselves) the pending sum stays a candidate too: right when the readers are linear and pass it
    on."""
    if not out.partial or ctx.fanout(op.outputs[0]) <= 1:
        return [Candidate(in_specs, (out,), work_axes=work_axes)]
    axes = tuple(a for a in ctx.mesh.axis_names if a in out.partial)
    shape = ctx.graph.tensors[op.outputs[0]].shape
    whole = ShardingSpec(dims=out.dims)
    nbytes = ctx.graph.tensors[op.outputs[0]].nbytes / max(1, whole.num_shards(ctx.mesh))
    work = work_axes if work_axes is not None else frozenset(a for d in out.dims for a in d) | out.partial
    cands = [Candidate(in_specs, (out,), work_axes=work_axes)] if pending else []
    cands.append(Candidate(in_specs, (whole,), comm=(("all_reduce", axes, nbytes),), work_axes=work))
    for i, d in enumerate(out.dims):
        if not d and shape[i] % ctx.size(axes) == 0:
            dims = tuple(axes if j == i else e for j, e in enumerate(out.dims))
            cands.append(Candidate(in_specs, (ShardingSpec(dims=dims),), comm=(("reduce_scatter", axes, nbytes),),
                                   work_axes=work))
    return cands


def enumerate_specs(shape: Sequence[int], ctx: RuleContext) -> list[ShardingSpec]:
    """All non-partial specs of a tensor of ``shape`` whose split dimensions divide evenly."""
    return [ShardingSpec(dims=dims) for dims in assignments(list(shape), ctx)]


def replicated(shape: Sequence[int]) -> ShardingSpec:
    return ShardingSpec.replicated(len(shape))


def passthrough(op: Op, ctx: RuleContext, whole: set[int]) -> list[Candidate]:
    """Every result takes one layout; operands of the result's rank follow it on the dimensions where
    their extent matches; dimensions in ``whole`` stay unsplit; other operands (scalars) replicate."""
    ins = ctx.in_shapes(op)
    outs = ctx.out_shapes(op)
    out_shape = outs[0]
    cands = []
    for spec in enumerate_specs(out_shape, ctx):
        if any(spec.dims[d] for d in whole):
            continue
        in_specs = []
        for s in ins:
            if len(s) == len(out_shape):
                dims = tuple(d if (i not in whole and s[i] == out_shape[i]) else () for i, d in enumerate(spec.dims))
                in_specs.append(ShardingSpec(dims=dims))
            else:
                in_specs.append(ShardingSpec.replicated(len(s)))
        cands.append(Candidate(tuple(in_specs), tuple(spec for _ in outs)))
    return cands


def dedupe(cands: Iterable[Candidate]) -> list[Candidate]:
    seen: set[tuple[tuple[ShardingSpec, ...], tuple[ShardingSpec, ...]]] = set()
    out = []
    for c in cands:
        key = (c.in_specs, c.out_specs)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# ---- pricing ------------------------------------------------------------------------------------------


def _dtype_of(op: Op, graph: Graph) -> str:
    for t in op.inputs:
        if graph.tensors[t].shape:
            return graph.tensors[t].dtype
    return graph.tensors[op.outputs[0]].dtype if op.outputs else "float32"


NO_KERNEL: frozenset[str] = frozenset({
    # an ordering constraint only: XLA passes its operands through as they are (``trace.remat`` sends a
    # block's kept values through one before replaying it); pricing it as a copy of them made selective
    # recompute look slower than full recompute once full's dead forward copies were priced at zero
    "optimization_barrier",
})
"""Primitives that move no data and run no kernel: priced at zero."""

INDEXED: frozenset[str] = frozenset({"gather", "scatter-add", "scatter_add", "scatter"})
"""Ops that touch only the indexed part of their big operand (``_indexed_bytes``)."""


def _indexed_bytes(op: Op, cand: Candidate, ctx: RuleContext) -> float:
    """Bytes per device a gather or scatter moves: a gather reads the rows it picks (its result's size) and
    writes them, not the whole operand (the cross-entropy's label gather reads 8,192 of GPT's [8, 1024, 51200]
    logits, not 1.7 GB); a scatter updates its operand in place (XLA's scatter aliases its operand and
    result), reading the updates and reading and writing the elements they touch. The indices are read."""
    g = ctx.graph

    def share(tid: int, spec: ShardingSpec) -> float:
        return g.tensors[tid].nbytes / max(1, spec.num_shards(ctx.mesh))

    def moved(tid: int, spec: ShardingSpec) -> float:  # what reaches memory: nothing for a fused value
        return 0.0 if tid in ctx.fused else share(tid, spec)

    if op.primitive == "gather":  # read the picked rows, write them
        out = share(op.outputs[0], cand.out_specs[0])
        return moved(op.inputs[1], cand.in_specs[1]) + out + moved(op.outputs[0], cand.out_specs[0])
    # scatter(operand, indices, updates): read the updates, read and write what they touch
    upd = share(op.inputs[2], cand.in_specs[2])
    return moved(op.inputs[1], cand.in_specs[1]) + moved(op.inputs[2], cand.in_specs[2]) + 2 * upd


SLICES: frozenset[str] = frozenset({"slice", "dynamic_slice"})
"""Ops that read only the part of their operand they select: XLA's slice kernel (or the fusion it joins)
loads the result's elements, not the whole operand. A layer stack unrolled (``trace.unroll``) slices each
layer's weights out of the stacked ``[L, ...]`` parameter; priced as a read of the whole stack, GPT-1.3B's
24 layers read every weight 24 times."""

BITCASTS: frozenset[str] = frozenset({"reshape", "squeeze", "expand_dims"})
"""Primitives that XLA compiles to a bitcast: a row-major array reshaped keeps its bytes in place, so the
result is the operand's buffer read another way (no kernel, no traffic). Their collectives, when a split
must move to reshape, are still priced. GPT-350M's backward priced its [8, 1024, 16, 192] -> [8, 1024, 3072]
reshape as a 50 MB copy each layer; the GPU trace has no kernel for it."""

_LOOP_FUSIBLE = frozenset(
    (*ELEMENTWISE, "convert_element_type", "copy", "copy_p", "reduce_precision", "stop_gradient",
     "broadcast_in_dim", "reshape", "squeeze", "expand_dims", "iota", "select_n", "transpose", "slice",
     # ``split`` lowers to slices, and XLA's loop fusion takes a concatenate: a rotary embedding's halves
     # and their rotation never reach memory (llama-7b's RoPE was priced at 164 ms of traffic each way)
     "split", "concatenate")
)
_FUSIBLE_CONSUMERS = _LOOP_FUSIBLE | frozenset(REDUCTIONS)


def fused_tensors(graph: Graph) -> frozenset[int]:
    """Tensors that never reach memory because XLA fuses their producer into every consumer.

    XLA's loop and input fusion turn a chain of elementwise/layout ops ending in a reduction into one
    kernel that reads the chain's inputs and writes its results once. A tensor counts as fused when its
    producer is loop-fusible, every consumer is loop-fusible or a reduction, and it is not a graph output.
    Pricing each op's bytes without those tensors is what keeps the roofline of a LayerNorm or an Adam
    update near one read and one write, instead of one per primitive (7x too slow on GPT before)."""
    outs = set(graph.outputs)
    fused = []
    for op in graph.ops:
        if op.primitive not in _LOOP_FUSIBLE:
            continue
        for tid in op.outputs:
            t = graph.tensors[tid]
            if tid not in outs and t.consumers and all(
                graph.ops[c].primitive in _FUSIBLE_CONSUMERS for c in t.consumers
            ):
                fused.append(tid)
    return frozenset(fused)


KERNEL_CAP = 64
"""Most kernels (and leaves) tracked per op in ``fusion_kernels``; beyond it a fused value is as good as
materialised, so the exact number no longer changes a decision."""


def _kernel_sets(graph: Graph, fused: frozenset[int], dead: frozenset[int]) -> dict[int, frozenset[int]]:
    """op id -> the kernels (named by their root op) that compute it: an op with a result that reaches memory
    is a kernel's root; an op all of whose results are fused runs inside every kernel its readers run in."""
    kernels: dict[int, frozenset[int]] = {}
    for op in reversed(graph.ops):
        if op.id in dead:
            continue
        if op.outputs and all(o in fused for o in op.outputs):
            into: set[int] = set()
            for o in op.outputs:
                for c in graph.tensors[o].consumers:
                    into |= kernels.get(c, frozenset())
            kernels[op.id] = frozenset(into if len(into) <= KERNEL_CAP else sorted(into)[:KERNEL_CAP])
        else:
            kernels[op.id] = frozenset((op.id,))
    return kernels


def _loop_shape(graph: Graph, root: int) -> tuple[Any, ...]:
    """What XLA's sibling multi-output fusion compares: a reduction's operand and result shapes, a loop
    fusion's result shape; any other root (a dot, a gather) is a kernel of its own."""
    op = graph.ops[root]
    if op.primitive in REDUCTIONS and op.inputs and op.outputs:
        return ("reduce", graph.tensors[op.inputs[0]].shape, graph.tensors[op.outputs[0]].shape)
    if op.primitive in _LOOP_FUSIBLE and op.outputs:
        return ("loop", graph.tensors[op.outputs[0]].shape)
    return ("own", root)


def fusion_kernels(graph: Graph, fused: frozenset[int],
                   dead: frozenset[int] = frozenset()) -> tuple[frozenset[int], dict[int, int]]:
    """How many kernels read a fused value's operands: (the fused tensors, op id -> kernels, where > 1).

    A fused value costs no traffic of its own (``fused_tensors``), but it is computed inside every kernel
    that reads it, and each of those kernels reads the value's operands from memory. A softmax here is three
    kernels over the scores (its max, its sum, the normalised result: each reads the one before), and the
    backward's two recompute the probabilities from the scores too. Profiler traces on one H100 (2026-11-26,
    ``benchmarks/data/traces_h100_2026-11-26``), a layer's softmax forward and backward:

    ==========================  ==========  ==========  ==========================
    step                        measured    priced now  priced before (one read)
    GPT-350M bf16 b8            347 + 422   377 + 377   189 + 189 us
    GPT-125M fp32 b8            441 + 528   564 + 564   282 + 282 us
    ==========================  ==========  ==========  ==========================

    (XLA ran the forward as two kernels, the sum and the normalisation in one: fp32 scores are over-priced by
    one read forward.) Two rules from XLA's GPU fusion:

    * Kernels that are siblings (reductions of the same operand shape to the same result shape, or loop
      fusions of the same result shape) and do not read each other's results are one multi-output kernel
      (a LayerNorm's mean and mean square): they read an operand once.
    * A fused value read by k > 1 kernels is materialised instead, written once and read by each, when that
      moves fewer bytes (k x its bytes < (k - 1) x its operands' bytes): the residual stream's adds, whose
      recomputation would read two values a kernel and chain through every later layer. Priority fusion
      makes the same comparison (``GpuPerformanceModel``: duplicated reads against a write and reads).
    """
    counted: dict[frozenset[int], int] = {}

    def kernel_count(kernels: dict[int, frozenset[int]], leaves: dict[int, frozenset[int]], op_id: int) -> int:
        """The kernels that compute ``op_id``, siblings that do not read each other's results counted once."""
        roots = kernels.get(op_id, frozenset())
        if len(roots) <= 1:
            return len(roots)
        hit = counted.get(roots)
        if hit is not None:
            return hit
        groups: list[tuple[tuple[Any, ...], list[int]]] = []
        for r in sorted(roots):
            key = _loop_shape(graph, r)
            outs = frozenset(graph.ops[r].outputs)
            reads = leaves.get(r, frozenset())
            for k, members in groups:
                if k == key and key[0] != "own" and all(
                        reads.isdisjoint(graph.ops[m].outputs) and outs.isdisjoint(leaves.get(m, ()))
                        for m in members):
                    members.append(r)
                    break
            else:
                groups.append((key, [r]))
        counted[roots] = len(groups)
        return len(groups)

    def sweep(fz: frozenset[int], decide: tuple[dict[int, frozenset[int]], dict[int, frozenset[int]]] | None = None,
              materialise: set[int] | None = None) -> tuple[dict[int, frozenset[int]], dict[int, frozenset[int]]]:
        """One forward pass: each op's leaves (the tensors in memory its computation reads, through fused
        values). With ``decide`` (the kernels and leaves of a pass before), add to ``materialise`` the fused
        values that are cheaper written once."""
        kernels = _kernel_sets(graph, fz, dead)
        leaves: dict[int, frozenset[int]] = {}
        for op in graph.ops:
            if op.id in dead:
                continue
            lv: set[int] = set()
            for t in op.inputs:
                tt = graph.tensors[t]
                if not tt.shape:
                    continue
                if t in fz and tt.producer is not None and tt.producer in leaves:
                    lv |= leaves[tt.producer]
                else:
                    lv.add(t)
            lv_f = frozenset(lv if len(lv) <= KERNEL_CAP else sorted(lv)[:KERNEL_CAP])
            if decide is not None and materialise is not None and op.outputs and all(o in fz for o in op.outputs):
                k = kernel_count(*decide, op.id)
                if k > 1:
                    operands = sum(graph.tensors[t].nbytes for t in lv_f)
                    own = sum(graph.tensors[o].nbytes for o in op.outputs)
                    if k * own < (k - 1) * operands:
                        materialise.add(op.id)
                        lv_f = frozenset(op.outputs)
            leaves[op.id] = lv_f
        return kernels, leaves

    chosen: set[int] = set()
    sweep(fused, sweep(fused), chosen)
    counted.clear()  # counts below are of the kernels once values are materialised
    if chosen:
        fused = frozenset(t for t in fused if graph.tensors[t].producer not in chosen)
    kernels, leaves = sweep(fused)
    copies: dict[int, int] = {}
    for op in graph.ops:
        if op.id in dead or not op.outputs or not all(o in fused for o in op.outputs):
            continue
        if not any(t not in fused and graph.tensors[t].shape for t in op.inputs):
            continue  # reads nothing from memory itself
        k = kernel_count(kernels, leaves, op.id)
        if k > 1:
            copies[op.id] = k
    return fused, copies


def price(op: Op, cand: Candidate, ctx: RuleContext, cost: CostModel) -> Strategy:
    """Roofline compute on the per-device share of the work, plus the candidate's own collectives; zero
    for a dead op (``RuleContext.dead``), which the compiled step does not run, and for an op that runs
    no kernel (``NO_KERNEL``)."""
    if op.id in ctx.dead or op.primitive in NO_KERNEL:
        return Strategy(in_specs=cand.in_specs, out_specs=cand.out_specs, compute_time=0.0, comm_time=0.0)
    graph = ctx.graph
    work_axes = cand.work_axes
    if work_axes is None:
        work_axes = cand.out_specs[0].axes_used if cand.out_specs else frozenset()
    shards = ctx.size(work_axes)
    nbytes = 0.0
    if op.primitive in INDEXED:
        nbytes = _indexed_bytes(op, cand, ctx)
    elif op.primitive not in BITCASTS:
        reads = ctx.copies.get(op.id, 1)  # a fused op's operands are read by every kernel that computes it
        for i, (tid, spec) in enumerate(zip(op.inputs, cand.in_specs, strict=True)):
            t = graph.tensors[tid]
            if t.nbytes and tid not in ctx.fused:
                share = t.nbytes / max(1, spec.num_shards(ctx.mesh))
                if i == 0 and op.primitive in SLICES:  # the selected elements only
                    out = graph.tensors[op.outputs[0]]
                    share = min(share, out.nbytes / max(1, cand.out_specs[0].num_shards(ctx.mesh)))
                nbytes += reads * share
        for tid, spec in zip(op.outputs, cand.out_specs, strict=True):
            t = graph.tensors[tid]
            if t.nbytes and tid not in ctx.fused:
                nbytes += t.nbytes / max(1, spec.num_shards(ctx.mesh))
    if op.primitive == "conv_general_dilated":
        compute = cost.conv_time(op.flops / shards, nbytes, _dtype_of(op, graph))
    else:
        compute = cost.compute_time(op.flops * cand.work_scale / shards, nbytes, _dtype_of(op, graph),
                                    matmul=costs.on_matmul_units(op))
    steps = tuple(
        CollectiveStep(kind=k, axes=tuple(ax), nbytes=b, time=cost.collective_time(k, b, ax))
        for k, ax, b in cand.comm
    )
    if cand.hidden:  # each hidden step at its share of what outlasts the compute
        beside = [(k, tuple(ax), b, cost.collective_time(k, b, ax)) for k, ax, b in cand.hidden]
        total = math.fsum(t for *_, t in beside)
        paid = max(0.0, total - compute) / total if total > 0 else 0.0
        steps += tuple(CollectiveStep(kind=k, axes=ax, nbytes=b, time=t * paid) for k, ax, b, t in beside)
    return Strategy(
        in_specs=cand.in_specs,
        out_specs=cand.out_specs,
        compute_time=compute,
        comm_time=math.fsum(s.time for s in steps),
        comm=steps,
    )


def fallback_candidate(op: Op, ctx: RuleContext) -> Candidate:
    return Candidate(
        in_specs=tuple(replicated(s) for s in ctx.in_shapes(op)),
        out_specs=tuple(replicated(s) for s in ctx.out_shapes(op)),
    )


def strategies_for(op: Op, ctx: RuleContext, cost: CostModel, warned: set[str] | None = None) -> list[Strategy]:
    """Priced strategies of ``op``; the replicated fallback when no rule applies. With ``warned`` (a planning
    run's record), a primitive that falls back is added to it and, unless deliberate (``FALLBACK``),
    reported once per process."""
    rule = RULES.get(op.primitive)
    cands: list[Candidate] = []
    if rule is not None:
        cands = dedupe(rule(op, ctx))
    if not cands:
        if rule is None and warned is not None and op.primitive not in warned:
            warned.add(op.primitive)
            if op.primitive in FALLBACK:
                log.debug("%r is replicated by design (registry.FALLBACK)", op.primitive)
            else:
                unruled.warn_once(
                    op.primitive,
                    "no sharding rule for primitive %r (first seen at %s); its operands and results "
                    "are replicated",
                    op.primitive,
                    op.source or "an unknown location",
                )
        cands = [fallback_candidate(op, ctx)]
    return [price(op, c, ctx, cost) for c in cands]
