"""Pricing parts of a pipelined step with the intra-op planner: one layer or one stage on one submesh.

``plan_part`` plans a stage's (or a layer's) ops the way a pipeline runs them: its update ops (run once
per step: parameters, gradients, optimizer state) first, then its microbatched ops (forward and backward,
run once per microbatch) in the memory the update leaves, their activations counted once per microbatch
in flight. The microbatched ops' results that leave as pending sums (data-parallel weight gradients)
are accumulated unreduced and reduced once per step (``pipeline.unreduced``): the microbatch plan is
solved with that reduction weighted ``1/B``, and its price is split off the microbatch time into
``Part.reduce``, paid once per step beside the update. ``price_layers`` gives the stage DP its tables: every layer on every submesh shape, layers
with the same ops priced once per shape.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.pipeline.partition import SubGraph, subgraph
from autoshard.planner.build import combined_reductions
from autoshard.planner.deadline import Deadline
from autoshard.planner.plan import Plan, PlanError
from autoshard.planner.planning import PROBLEMS, ProblemCache, plan_graph
from autoshard.planner.seeds import Assignment
from autoshard.planner.shares import SHARES
from autoshard.trace.graph import Graph, Scope
from cost_models import CostModel, LogicalMesh, ShardingSpec


@dataclasses.dataclass(frozen=True, slots=True)
class Priced:
    """Some ops planned: ``time`` (seconds), ``memory`` (bytes per device, activations counted as many
    times as asked), the plan and the sub-graph it was made on (None when there was nothing to plan)."""

    time: float
    memory: float
    plan: Plan | None
    sub: Any
    reduce: float = 0.0  # seconds to reduce the pending sums it returns, once (not counted in ``time``)
    held: float | None = None  # bytes of activations kept into the backward pass, once (``Plan.held_memory``)

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.time)


NOTHING = Priced(0.0, 0.0, None, None)
INFEASIBLE = Priced(math.inf, math.inf, None, None)


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """A part of the step planned as a pipeline runs it (see the module docstring)."""

    micro: Priced
    update: Priced
    solves: int

    @property
    def time(self) -> float:
        """Seconds per microbatch (forward and backward, the gradient reduction excluded)."""
        return self.micro.time

    @property
    def once(self) -> float:
        """Seconds once per step: reducing the accumulated gradients, then the update."""
        return self.micro.reduce + self.update.time

    @property
    def memory(self) -> float:
        return self.micro.memory + self.update.memory


def submesh_cost(cost: CostModel, shape: tuple[int, int], view: tuple[int, int] | None = None) -> CostModel:
    """The cost model of a stage's submesh: (1, d) is a 1-D mesh over the mesh's inner axis name, (h, D)
    keeps both axes. Links are the cluster's (inside a host: fast; across hosts: slow). ``view`` = (a, b)
    with ``a·b = d`` lays a one-host submesh out as a 2-D logical mesh instead, both axes on the host's
    link (Alpa's logical mesh shapes: e.g. tensor parallel over 4 devices beside data parallel over 2);
    its axes are named after the host's axis ``y`` as ``y0`` and ``y1`` (never the inter-host axis's
    name: both run inside the host)."""
    names = cost.mesh.axis_names
    link_of = dict(zip(names, cost.mesh.links, strict=True))
    if view is not None:
        if shape[0] != 1 or len(view) != 2 or view[0] * view[1] != shape[1]:
            raise ValueError(f"view {view} is not a 2-D layout of the one-host submesh {shape}")
        inner = link_of[names[-1]]
        axes = (f"{names[-1]}0", f"{names[-1]}1")
        return dataclasses.replace(cost, mesh=LogicalMesh(axis_names=axes, shape=tuple(view), links=(inner, inner)))
    if shape[0] == 1:
        mesh = LogicalMesh(axis_names=(names[-1],), shape=(shape[1],), links=(link_of[names[-1]],))
    else:
        mesh = LogicalMesh(axis_names=names, shape=shape, links=tuple(link_of[n] for n in names))
    return dataclasses.replace(cost, mesh=mesh)


def plan_ops(graph: Graph, ops: Sequence[int], cost: CostModel, hardware: str, budget: float | None,
             time_budget_s: float, activation_weight: float = 1.0, reductions_per_call: float = 1.0,
             starts: Sequence[Mapping[str, ShardingSpec]] = (), solve: bool = True) -> Priced:
    """Plan some ops; ``memory`` is the plan's peak with activations counted ``activation_weight`` times.
    ``reductions_per_call``: how often per call the pending sums the ops return are reduced (``1/B`` for a
    microbatch's gradients); their whole reduction is ``Priced.reduce``, and ``time`` leaves it out.
    ``starts``: layouts of some inputs (by name) the solve also starts from; ``solve=False``: the best start
    as it is, where one fits (both ``planning.plan_graph``'s)."""
    if not ops:
        return NOTHING
    sub = subgraph(graph, ops)
    try:
        plan = plan_graph(sub.graph, cost, hardware=hardware, memory_budget=budget, time_budget_s=time_budget_s,
                          activation_weight=activation_weight, reduction_weight=reductions_per_call,
                          starts=[x for x in starts if x], problems=ProblemCache.of(sub.graph), solve=solve)
    except PlanError:
        return Priced(math.inf, math.inf, None, sub)
    # the plan's predicted time counts the reduction of the pending sums it returns once, in full
    # (``readback.issued``), whatever weight the solve gave it: all of it comes off the time per call
    reduce = output_reduction(sub.graph, plan, cost)
    return Priced(plan.predicted_step_time - reduce, plan.peak_memory, plan, sub, reduce, plan.held_memory)


def output_reduction(graph: Graph, plan: Plan, cost: CostModel) -> float:
    """Seconds to reduce the pending sums among ``graph``'s results under ``plan`` (all-reduce, or what
    ``CostModel.reshard_time`` prices for leaving them partial to materialised, a gradient's all-reduce one
    of those XLA issues as one, as ``planner.build`` does)."""
    table = plan.specs.get((), {})
    grads, k = combined_reductions(graph)
    total = 0.0
    for tid in dict.fromkeys(graph.outputs):
        spec = table.get(tid)
        if spec is not None and spec.partial:
            t = graph.tensors[tid]
            total += cost.reshard_time(t.shape, t.dtype, spec, ShardingSpec(dims=spec.dims),
                                       combine=k if tid in grads else 1)
    return total


def plan_part(graph: Graph, micro_ops: Sequence[int], update_ops: Sequence[int], cost: CostModel, hardware: str,
              budget: float | None, time_budget_s: float, inflight: float, fallback: float | None = None,
              microbatches: int = 1, starts: tuple[Sequence[Any], Sequence[Any]] = ((), ()),
              solve: bool = True) -> Part:
    """The update ops planned under ``budget``, then the microbatched ops under what they leave, with
    their activations counted ``inflight`` times and their pending-sum results reduced once per
    ``microbatches``. With ``fallback`` (a larger budget), a part that does not fit is priced again under
    it, so that the stage DP sees what it would cost rather than nothing. ``starts``: where the microbatch
    and the update solves also start (``plan_graph``'s starts: ``layouts_of_layers``,
    ``assignment_of_layers``); ``solve=False``: each the best of its starts, unsolved (``plan_ops``)."""
    per_call = 1.0 / max(1, microbatches)
    mstart, ustart = tuple(starts[0]), tuple(starts[1])
    update = plan_ops(graph, update_ops, cost, hardware, budget, time_budget_s, starts=ustart, solve=solve)
    solves = 1
    if not update.feasible and fallback is not None:
        update = plan_ops(graph, update_ops, cost, hardware, fallback, time_budget_s, starts=ustart)
        solves += 1
    rest = None if budget is None else budget - update.memory
    micro = INFEASIBLE
    if rest is None or rest > 0:
        micro = plan_ops(graph, micro_ops, cost, hardware, rest, time_budget_s, inflight, per_call, mstart, solve)
        solves += 1
    if not micro.feasible and fallback is not None and math.isfinite(update.memory):
        micro = plan_ops(graph, micro_ops, cost, hardware, fallback, time_budget_s, inflight, per_call, mstart)
        solves += 1
    for ops in (update_ops, micro_ops):  # a problem is kept for the fallback's solve only: a stage's is large
        if ops:
            subgraph(graph, ops).graph.memo(PROBLEMS).clear()
    return Part(micro, update, solves)


def layouts_of_layers(graph: Graph, priced: Sequence[Priced], layer_ops: Sequence[Sequence[int]],
                      stage_ops: Sequence[int]) -> dict[str, ShardingSpec]:
    """The layouts the layers' own plans (``priced``, one per layer, possibly made on an identical layer)
    give the inputs of a stage made of them (``stage_ops``), by name: where the whole-stage solve starts,
    so that a stage plan is never worse than its layers' plans the stage DP summed (up to resharding
    between them) however little time the larger solve has."""
    if not stage_ops:
        return {}
    stage = subgraph(graph, stage_ops)
    names = [graph.tensors[t].name for t in stage.tensors[:len(stage.graph.inputs)]]
    wanted = {n for n in names if n and names.count(n) == 1}
    out: dict[str, ShardingSpec] = {}
    for p, ops in zip(priced, layer_ops, strict=True):
        if p.plan is None or not ops:
            continue
        sub = subgraph(graph, ops)
        table = p.plan.specs.get((), {})
        for k, tid in enumerate(sub.tensors[:len(sub.graph.inputs)]):
            spec, name = table.get(k), graph.tensors[tid].name
            if spec is not None and not spec.partial and name in wanted:
                out[name] = spec
    return out


def assignment_of_layers(graph: Graph, priced: Sequence[Priced], layer_ops: Sequence[Sequence[int]],
                         stage_ops: Sequence[int]) -> Assignment:
    """The layers' own plans (``priced``, one per layer, possibly made on an identical layer) joined into
    the layouts of every tensor of a stage made of them (``stage_ops``), keyed as the stage's problem
    numbers them: a tensor crossing from one layer to the next keeps its producer's layout (the reader's
    resharding is then the stage solve's to price). The whole-stage solve starts from it (``seeds``), so
    that the stage plan is at worst the sum the stage DP saw plus that resharding."""
    out: dict[tuple[Scope, int], ShardingSpec] = {}
    if not stage_ops:
        return Assignment("the layers' plans", out)
    stage = subgraph(graph, stage_ops)
    for p, ops in zip(priced, layer_ops, strict=True):
        mine = reuse(graph, p, ops) if p.plan is not None and ops else None
        if mine is not None and mine.sub is not None:
            _keyed_into(out, remap(mine), stage)
    return Assignment("the layers' plans", out)


def _keyed_into(out: dict[tuple[Scope, int], ShardingSpec], specs: Mapping[Scope, Mapping[int, ShardingSpec]],
                sub: SubGraph, op_map: Mapping[int, int] | None = None, tensor_map: Mapping[int, int] | None = None,
                ) -> None:
    """``specs`` (keyed by the step's op and tensor ids, as ``remap`` gives them) added to ``out`` keyed as
    ``sub``'s problem numbers them (its tensors by position; a body's tensors by the position of the op that
    holds it), the first layout of a key kept. ``op_map`` / ``tensor_map`` carry the step's ids first (a plan
    of other ops onto their matches); an id they or ``sub`` lack is dropped."""
    tensor_of = {t: k for k, t in enumerate(sub.tensors)}
    op_of = {i: k for k, i in enumerate(sub.ops)}
    for scope, table in specs.items():
        if scope == ():
            for tid, spec in table.items():
                mine = tid if tensor_map is None else tensor_map.get(tid)
                if mine is not None and mine in tensor_of:
                    out.setdefault(((), tensor_of[mine]), spec)
            continue
        (op, b), *rest = scope
        mine_op = op if op_map is None else op_map.get(op)
        if mine_op is not None and mine_op in op_of:
            local: Scope = ((op_of[mine_op], b), *rest)
            for tid, spec in table.items():
                out.setdefault((local, tid), spec)


def op_digest(graph: Graph, i: int) -> str:
    """One op as its kind, params and operand/result shapes: equal for the same op of two copies of a block."""
    op = graph.ops[i]
    ins = ",".join(f"{graph.tensors[t].shape}{graph.tensors[t].dtype}" for t in op.inputs)
    outs = ",".join(f"{graph.tensors[t].shape}{graph.tensors[t].dtype}" for t in op.outputs)
    return f"{op.primitive}|{op.params}|{ins}|{outs}"


def carried_assignment(graph: Graph, priced: Priced, source_ops: Sequence[int], ops: Sequence[int]) -> Assignment:
    """The plan ``priced`` made for ``source_ops``, carried to the ops of ``ops`` that match them, keyed as
    ``ops``' own problem numbers its tensors: a start for a layer that holds a copy of an already-planned
    block beside other ops (GPT's first layer: the embedding and block 0; the block's plan is the one
    priced for the 126 other layers). Ops are matched by aligning the two op sequences on ``op_digest``
    (``difflib``'s longest matching runs); a matched op's results and operands take the source's layouts,
    its bodies' tensors too. What matches nothing is left to ``assignment_choice`` (the cheapest strategy)
    and to the solve."""
    out: dict[tuple[Scope, int], ShardingSpec] = {}
    if priced.plan is None or priced.sub is None or not ops or not source_ops:
        return Assignment("a planned layer's layouts", out)
    mine, theirs = sorted(ops), sorted(source_ops)
    matcher = difflib.SequenceMatcher(None, [op_digest(graph, i) for i in mine],
                                      [op_digest(graph, i) for i in theirs], autojunk=False)
    op_pair: dict[int, int] = {}  # source op -> my op
    tensor_pair: dict[int, int] = {}  # source tensor -> my tensor
    for a, b, size in matcher.get_matching_blocks():
        for j in range(size):
            mi, si = mine[a + j], theirs[b + j]
            op_pair[si] = mi
            for st, mt in zip(graph.ops[si].inputs + graph.ops[si].outputs,
                              graph.ops[mi].inputs + graph.ops[mi].outputs, strict=True):
                tensor_pair.setdefault(st, mt)
    _keyed_into(out, remap(priced), subgraph(graph, mine), op_pair, tensor_pair)
    return Assignment("a planned layer's layouts", out)


def reuse(graph: Graph, priced: Priced, ops: Sequence[int]) -> Priced | None:
    """The plan of an identical set of ops, carried over to ``ops`` (their sub-graphs number tensors the
    same way: inputs by first use, then results in schedule order); None if the numbering differs."""
    if priced.plan is None or not ops:
        return Priced(priced.time, priced.memory, priced.plan, None, priced.reduce)
    sub = subgraph(graph, ops)
    same = [(t.shape, t.dtype) for t in sub.graph.tensors] == [(t.shape, t.dtype) for t in priced.sub.graph.tensors]
    return Priced(priced.time, priced.memory, priced.plan, sub, priced.reduce) if same else None


def remap(priced: Priced) -> dict[Scope, dict[int, ShardingSpec]]:
    """A sub-graph plan's specs keyed by the step's op and tensor ids."""
    if priced.plan is None:
        return {}
    sub = priced.sub
    out: dict[Scope, dict[int, ShardingSpec]] = {}
    for scope, table in priced.plan.specs.items():
        if scope == ():
            out[()] = {sub.tensors[t]: s for t, s in table.items()}
        else:
            (op, b), *rest = scope
            out[((sub.ops[op], b), *rest)] = dict(table)
    return out


def signature(graph: Graph, ops: Sequence[int]) -> str:
    """A digest of some ops that is equal for identical layers: primitives, params, shapes, and which
    operands come from inside the set."""
    h = hashlib.sha1()
    local: dict[int, int] = {}
    for i in ops:
        op = graph.ops[i]
        h.update(op.primitive.encode())
        h.update(repr(op.params).encode())
        for t in op.inputs:
            ten = graph.tensors[t]
            h.update(f"{local.get(t, -1)}:{ten.shape}:{ten.dtype}:{ten.role.value if t not in local else ''}".encode())
        for t in op.outputs:
            local[t] = len(local)
            h.update(f"{graph.tensors[t].shape}:{graph.tensors[t].dtype}".encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True, slots=True)
class LayerPrices:
    """Per layer and submesh shape: seconds per microbatch, bytes of one microbatch's activations, seconds
    once per step (the accumulated gradients' reduction and the update) and bytes of the update. ``solves``: intra-op solves spent; ``distinct``: layers with different ops."""

    micro_time: np.ndarray
    micro_memory: np.ndarray
    update_time: np.ndarray
    update_memory: np.ndarray
    solves: int
    distinct: int
    parts: tuple[tuple[Part, ...], ...] = ()  # [layer][shape]: the plans behind the prices
    # [layer, shape]: bytes a microbatch's pass needs beyond its held activations (a recomputed block's
    # values, the backward's temporaries), which a stage needs for one layer at a time; None: none apart
    micro_transient: np.ndarray | None = None


def price_layers(graph: Graph, micro_ops: Sequence[Sequence[int]], update_ops: Sequence[Sequence[int]],
                 costs: Sequence[CostModel], hardware: str, memory_budget: float | None, time_budget_s: float,
                 inflight: Sequence[int], num_devices: int, num_microbatches: int = 1, chunks: int = 1,
                 chunk_inflight: Sequence[Sequence[int]] | None = None,
                 deadline: Deadline | None = None) -> LayerPrices:
    """Every layer on every submesh (``costs``: one cost model per shape), each planned with ``plan_part``.

    A layer is planned under its share of a stage's memory: on a submesh of ``n`` devices the cluster
    holds about ``S = num_devices / n`` stages of ``num_layers · n / num_devices`` layers each. Layer
    ``ℓ`` of ``L`` falls in (virtual) stage ``u = ⌊ℓ·S·chunks / L⌋``, on physical stage ``p = u mod S``,
    which keeps ``inflight[S - 1 - p]`` microbatches in flight (with ``chunk_inflight``, an interleaved
    schedule's, chunk ``⌊u / S⌋`` keeps ``chunk_inflight[S - 1 - p][⌊u / S⌋]`` of its own); identical
    layers are planned once, with the largest count among their positions (the first stage's for a
    repeated block; a unique last layer, the head, its own smaller one), and their activations count that
    many times, so that the layer picks layouts its stage can hold. A layer that cannot fit its share is priced again under the whole budget.
    Gradients are reduced once per ``num_microbatches`` (``plan_part``).

    ``time_budget_s`` is shared by the distinct layers' plans (two solves per shape) in proportion to how
    many layers each one prices: a block repeated 48 times decides 48 layers' price, the embedding one,
    and a short solve of a few hundred nodes can end 3x above its optimum (GPT-39B's block on 2x4: 35 ms
    a microbatch after 0.1 s, 11 ms after 0.5 s), noise that moves the stage DP's cut. Every distinct
    layer's fraction is at least ``1 / (4 · distinct)`` before normalising (the embedding and the head
    keep a useful solve), and every solve at least ``SHARES.min_layer_seconds`` (GPT-39B's first layer, the
    embedding and a block, on 2x4: 41.7 ms a microbatch after 0.05 s, 14.1 ms after 0.3 s; a solve that
    proves its optimum returns sooner).

    The most repeated layer (the block) is priced on every shape first; the other layers then go shape by
    shape, the shapes ranked by the block's step on them (``_ranked_shapes``). Once ``deadline`` (the whole
    planning call's) is spent and every layer has a price on some shape, the shapes left are not priced: their
    columns are infinite, which the stage DP never chooses (GPT-1.3B on 2x4 under a 5 s budget: 4.9 s of
    pricing on 5 shapes, past the budget before it began)."""
    num_layers, num_shapes = len(micro_ops), len(costs)
    signatures = [signature(graph, micro_ops[ell]) + signature(graph, update_ops[ell]) for ell in range(num_layers)]
    distinct = len(set(signatures))

    def held(ell: int, stages: int) -> int:
        u = ell * stages * chunks // num_layers
        p, c = u % stages, u // stages
        r = min(stages - 1 - p, len(inflight) - 1)
        return chunk_inflight[r][c] if chunk_inflight is not None and c < len(chunk_inflight[r]) else inflight[r]

    weights: dict[tuple[Any, ...], float] = {}
    for m, cost in enumerate(costs):
        stages = max(1, num_devices // cost.mesh.num_devices)
        for ell in range(num_layers):
            key = (signatures[ell], m)
            weights[key] = max(weights.get(key, 0.0), float(held(ell, stages)))
    frac = {sig: max(signatures.count(sig) / num_layers, 1 / (4 * distinct)) for sig in set(signatures)}
    seconds = {sig: max(SHARES.min_layer_seconds, time_budget_s * x / sum(frac.values()) / max(1, 2 * num_shapes))
               for sig, x in frac.items()}
    out = [np.zeros((num_layers, num_shapes)) for _ in range(4)]
    transient = np.zeros((num_layers, num_shapes))
    cache: dict[tuple[Any, ...], tuple[Part, float]] = {}
    planned_on: dict[str, int] = {}  # signature -> the layer its plans were made on
    parts: list[list[Part | None]] = [[None] * num_shapes for _ in range(num_layers)]
    solves = 0

    def _planned(key: tuple[Any, ...], ell: int, m: int, cost: CostModel, stages: int) -> tuple[Part, float]:
        """Layer ``ell`` on shape ``m`` (``stages`` of it in the cluster) planned with its activations counted
        ``weights[key]`` times."""
        nonlocal solves
        weight = weights[key]
        share = None if memory_budget is None else memory_budget * min(1.0, stages / num_layers)
        source = next((k for k in planned_on if k != signatures[ell] and (k, m) in cache), None)
        starts: tuple[Sequence[Any], Sequence[Any]] = ((), ())
        if source is not None:
            theirs, src = cache[(source, m)][0], planned_on[source]
            carried = (carried_assignment(graph, theirs.micro, micro_ops[src], micro_ops[ell]),
                       carried_assignment(graph, theirs.update, update_ops[src], update_ops[ell]))
            starts = ((carried[0],) if carried[0] else (), (carried[1],) if carried[1] else ())
        part = plan_part(graph, micro_ops[ell], update_ops[ell], cost, hardware, share, seconds[signatures[ell]],
                         weight, fallback=memory_budget, microbatches=num_microbatches, starts=starts)
        solves += part.solves
        return part, weight

    def price(ell: int, m: int) -> None:
        """Layer ``ell`` on shape ``m``, planned unless an identical layer was."""
        cost = costs[m]
        key: tuple[Any, ...] = (signatures[ell], m)
        stages = max(1, num_devices // cost.mesh.num_devices)
        for fewer in (held(ell, stages), min(inflight)):
            if key in cache and not cache[key][0].micro.feasible and fewer < cache[key][1]:
                # no plan holds the most microbatches any copy of this layer keeps in flight: this copy gets
                # a plan for as many as its place keeps, or else as the last stage keeps (a stage late in
                # the pipeline may hold a block as traced that the first stages must recompute: ``stages``'
                # recompute per stage), which the stage DP places only where it fits
                key = (signatures[ell], m, fewer)
                weights[key] = float(fewer)
                if key not in cache:
                    cache[key] = _planned(key, ell, m, cost, stages)
        if key not in cache:
            cache[key] = _planned(key, ell, m, cost, stages)
        part, weight = cache[key]
        parts[ell][m] = part
        out[0][ell, m], out[2][ell, m], out[3][ell, m] = part.micro.time, part.once, part.update.memory
        out[1][ell, m], transient[ell, m] = held_and_transient(part.micro, weight)

    # the most repeated layer first, on every shape: the others start from its plan where their ops match
    # (GPT's first layer holds a copy of the block; ``carried_assignment``), and its prices rank the shapes
    order = sorted(range(num_layers), key=lambda x: (-signatures.count(signatures[x]), x))
    for ell in order:
        planned_on.setdefault(signatures[ell], ell)
    first = [ell for ell in order if signatures[ell] == signatures[order[0]]]
    for m in range(num_shapes):
        for ell in first:
            price(ell, m)
    rest = [ell for ell in order if signatures[ell] != signatures[order[0]]]
    ranked = _ranked_shapes(out[0][order[0]] + out[2][order[0]] / max(1, num_microbatches), costs, num_devices,
                            num_microbatches)
    for k, m in enumerate(ranked):
        if (k > 0 and deadline is not None and deadline.spent() and rest
                and all(np.isfinite(out[0][ell, ranked[:k]] + out[2][ell, ranked[:k]]).any() for ell in rest)):
            # the call's budget is spent and every layer has a price somewhere: the shapes its block runs least
            # efficiently on are left out (infinite: the stage DP cannot choose them)
            for a in out:
                a[np.ix_(rest, ranked[k:])] = math.inf
            deadline.cut(f"the pipeline's layers were priced on {k} of {num_shapes} submesh shapes (the block's "
                         "most efficient first)")
            break
        for ell in rest:
            price(ell, m)
    return LayerPrices(*out, solves=solves, distinct=distinct, parts=tuple(tuple(p) for p in parts),
                       micro_transient=transient)


def _ranked_shapes(block: np.ndarray, costs: Sequence[CostModel], num_devices: int,
                   num_microbatches: int) -> list[int]:
    """The shapes in the order of a step of the block alone on them: on a submesh of ``n`` of the ``N``
    devices the cluster runs ``S = N / n`` stages, each of ``L / S`` of the ``L`` blocks, so a step takes
    about ``(B + S - 1) · (L / S) · t = L · t · n · (B + S - 1) / N`` for the block's time ``t`` per
    microbatch (``block``, per shape) over ``B`` microbatches: ``t · n · (B + S - 1)`` ranks them
    (ties: the earlier shape first)."""
    def step(m: int) -> float:
        n = costs[m].mesh.num_devices
        stages = max(1, num_devices // n)
        return float(block[m]) * n * (num_microbatches + stages - 1)

    return sorted(range(len(costs)), key=lambda m: (step(m), m))


def held_and_transient(micro: Priced, weight: float) -> tuple[float, float]:
    """(bytes a microbatch in flight holds, bytes its pass needs besides, for one layer at a time) of a
    layer's microbatch plan made with its activations counted ``weight`` times: ``a`` = the plan's held
    activations and ``τ = peak − weight·a``; a plan that does not say (or did not fit) ``(peak / weight, 0)``.
    A stage of layers ``i..j`` holding ``h`` microbatches then needs ``Σ static + h·Σ a + max τ``
    (``stages``), where the per-layer peaks summed counted every layer's temporaries at once (GPT-39B as
    one stage of 48 blocks: 245 GB)."""
    if micro.held is None or not math.isfinite(micro.memory):
        return micro.memory / weight, 0.0
    return micro.held, max(0.0, micro.memory - weight * micro.held)
