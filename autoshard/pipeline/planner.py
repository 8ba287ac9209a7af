"""Plan a pipelined step: layers, stage costs from the intra-op planner, the stage DP, per-stage plans.

Inputs: the step traced at microbatch size, the cluster's cost model (a 1-D mesh ``(n,)`` is one host of
``n`` devices; a 2-D mesh ``(H, D)`` is ``H`` hosts of ``D``), ``B`` microbatches and a schedule.

1. ``partition.split_step`` and ``assign_layers`` give every op a layer ``ℓ ∈ [0, L)``.
2. For every layer ``ℓ`` and Alpa submesh shape ``m`` (``(1, 2^k)`` and ``(h, D)``), the intra-op planner
   plans the layer's microbatched ops and, separately, its update ops on a mesh of that shape. Layers
   with the same op signature (a stack of identical blocks) are planned once per shape. The stage tables
   of ``solvers.inter_op`` are then additive over layers:

       t[i, j, m] = Σ_{ℓ=i..j} T_micro(ℓ, m) + 2·X(i) / β            (forward activations in, cotangents out)
       σ[i, j, m] = Σ_{ℓ=i..j} M_update(ℓ, m)                        (parameters, gradients, optimizer state)
       α[i, j, m] = Σ_{ℓ=i..j} M_micro(ℓ, m)                         (one microbatch in flight)

   where ``X(i)`` is the bytes live across the cut before layer ``i`` and ``β`` the bandwidth of the
   mesh's slowest link. Each layer is planned under its share of a stage's memory (``budget · N /
   (n_m · L)``: on shape ``m`` about ``N / n_m`` stages of ``L·n_m / N`` layers) with its activations
   counted ``inflight`` times (the first stage's), so that it picks layouts a whole stage can hold; a
   layer that cannot fit its share is priced under the whole budget. Summing per-layer plans ignores
   resharding between layers inside a stage; the chosen stages are re-planned whole in step 4 (update
   ops first, then the microbatched ops in what memory is left, activations counted ``inflight(s)``
   times), and those plans give the reported times. Identical stages are planned once.
3. ``solvers.solve_inter_op`` picks stage boundaries and submeshes minimising
   ``Σ_s t_s + (B − 1)·max_s t_s`` under ``σ + inflight(r)·α <= budget``.
4. Each chosen stage is planned whole (update ops, then microbatched ops) on its submesh. The predicted
   step time is ``Σ_s t_s + (B − 1)·max_s t_s + max_s T_update(s)``.

Known limits: gradients are reduced per microbatch (a stage sharded data-parallel over a slow axis pays
that reduction ``B`` times, where accumulating partial sums would pay once); a ``scan`` over layers is
one forward op, so a scanned stack is one layer (trace with the layers unrolled to pipeline them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.pipeline.partition import (
    UPDATE,
    PipelineError,
    StepParts,
    assign_layers,
    forward_sequence,
    split_step,
    subgraph,
)
from autoshard.pipeline.schedules import SCHEDULE_NAMES, inflight_rule
from autoshard.planner.plan import Plan, PlanError, Scope, plan_graph
from autoshard.trace.graph import Graph
from cost_models import CostModel, LogicalMesh, ShardingSpec
from solvers.inter_op import InterOpInfeasibleError, InterOpProblem, alpa_submeshes, solve_inter_op

PIPELINE_PLAN_VERSION = 1


# ---- plan data -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: its layers, where it runs, what it costs, and its layouts (step tensor ids)."""

    layers: tuple[int, int]  # first, last (inclusive)
    submesh: tuple[int, int]  # (hosts, devices per host)
    origin: tuple[int, int]  # (first host, first device) of the submesh in the cluster
    mesh: LogicalMesh  # the logical mesh the stage was planned on
    micro_time: float  # seconds of forward + backward per microbatch, receiving its inputs included
    update_time: float  # seconds of the once-per-step update
    memory: float  # bytes per device: update state + in-flight microbatches' activations
    specs: Mapping[Scope, Mapping[int, ShardingSpec]]  # forward / backward programs
    update_specs: Mapping[Scope, Mapping[int, ShardingSpec]]

    @property
    def num_devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    def devices(self, cluster: tuple[int, int]) -> list[int]:
        """Device indices (row-major over the cluster's (hosts, devices per host)) of this stage."""
        h0, d0 = self.origin
        return [h * cluster[1] + d for h in range(h0, h0 + self.submesh[0])
                for d in range(d0, d0 + self.submesh[1])]


def _specs_to_json(specs: Mapping[Scope, Mapping[int, ShardingSpec]]) -> list[Any]:
    return [{"scope": [list(p) for p in scope], "tensors": {str(k): str(v) for k, v in sorted(table.items())}}
            for scope, table in specs.items()]


def _specs_from_json(data: list[Any]) -> dict[Scope, dict[int, ShardingSpec]]:
    return {tuple(tuple(p) for p in e["scope"]): {int(k): ShardingSpec.parse(v) for k, v in e["tensors"].items()}
            for e in data}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    """A pipelined plan as plain data: stages on submeshes, microbatches, schedule, predicted time."""

    mesh: LogicalMesh
    hardware: str
    num_microbatches: int
    schedule: str
    num_layers: int
    stages: tuple[StagePlan, ...]
    layer_of_op: tuple[int, ...]  # per op of the microbatch-sized trace
    predicted_step_time: float
    bubble_fraction: float
    peak_memory: float
    memory_budget: float | None
    solver: Mapping[str, Any]
    graph_digest: str  # of the microbatch-sized trace the op ids refer to

    @property
    def cluster(self) -> tuple[int, int]:
        return _cluster(self.mesh)

    def stage_of_op(self) -> tuple[int, ...]:
        stage_of_layer = {}
        for s, st in enumerate(self.stages):
            for layer in range(st.layers[0], st.layers[1] + 1):
                stage_of_layer[layer] = s
        return tuple(stage_of_layer[layer] for layer in self.layer_of_op)

    def verify(self, graph: Graph | None = None) -> None:
        expect = 0
        for s, st in enumerate(self.stages):
            if st.layers[0] != expect or st.layers[1] < st.layers[0]:
                raise PlanError(f"stage {s} covers layers {st.layers}; expected to start at layer {expect}")
            expect = st.layers[1] + 1
        if expect != self.num_layers:
            raise PlanError(f"the stages cover layers 0..{expect - 1} of {self.num_layers}")
        used = sum(st.num_devices for st in self.stages)
        if used > math.prod(self.mesh.shape):
            raise PlanError(f"the stages use {used} devices; the mesh has {math.prod(self.mesh.shape)}")
        if not math.isfinite(self.predicted_step_time) or self.predicted_step_time < 0:
            raise PlanError(f"predicted step time {self.predicted_step_time} is not finite and non-negative")
        if graph is not None and (len(graph.ops) != len(self.layer_of_op)
                                  or graph_digest(graph) != self.graph_digest):
            raise PlanError("this pipeline plan was made for another trace of the step (different ops); "
                                "plan again")

    # ---- serialisation -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "pipeline",
            "version": PIPELINE_PLAN_VERSION,
            "mesh": self.mesh.to_dict(),
            "hardware": self.hardware,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "num_layers": self.num_layers,
            "stages": [{
                "layers": list(st.layers), "submesh": list(st.submesh), "origin": list(st.origin),
                "mesh": st.mesh.to_dict(), "micro_time": st.micro_time, "update_time": st.update_time,
                "memory": st.memory, "specs": _specs_to_json(st.specs),
                "update_specs": _specs_to_json(st.update_specs),
            } for st in self.stages],
            "layer_of_op": list(self.layer_of_op),
            "predicted_step_time": self.predicted_step_time,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory": self.peak_memory,
            "memory_budget": self.memory_budget,
            "solver": dict(self.solver),
            "graph_digest": self.graph_digest,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PipelinePlan:
        if d.get("kind") != "pipeline" or d.get("version") != PIPELINE_PLAN_VERSION:
            raise PlanError(f"not a version-{PIPELINE_PLAN_VERSION} pipeline plan (kind={d.get('kind')!r}, "
                            f"version={d.get('version')!r})")
        stages = tuple(StagePlan(
            layers=tuple(s["layers"]), submesh=tuple(s["submesh"]), origin=tuple(s["origin"]),
            mesh=LogicalMesh.from_dict(s["mesh"]), micro_time=float(s["micro_time"]),
            update_time=float(s["update_time"]), memory=float(s["memory"]),
            specs=_specs_from_json(s["specs"]), update_specs=_specs_from_json(s["update_specs"]),
        ) for s in d["stages"])
        plan = cls(mesh=LogicalMesh.from_dict(d["mesh"]), hardware=d["hardware"],
                   num_microbatches=int(d["num_microbatches"]), schedule=d["schedule"],
                   num_layers=int(d["num_layers"]), stages=stages, layer_of_op=tuple(d["layer_of_op"]),
                   predicted_step_time=float(d["predicted_step_time"]),
                   bubble_fraction=float(d["bubble_fraction"]), peak_memory=float(d["peak_memory"]),
                   memory_budget=d["memory_budget"], solver=dict(d["solver"]), graph_digest=d["graph_digest"])
        plan.verify()
        return plan

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PipelinePlan:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def summary(self) -> str:
        from autoshard.planner.summary import format_pipeline_plan

        return format_pipeline_plan(self)

    def explain(self) -> str:
        """The summary plus the step time split into stage work, bubble and the update."""
        from autoshard.planner.explain import explain_pipeline

        return explain_pipeline(self)


# ---- helpers ---------------------------------------------------------------------------------------------


def graph_digest(graph: Graph) -> str:
    h = hashlib.sha1()
    for op in graph.ops:
        h.update(op.primitive.encode())
        for t in (*op.inputs, *op.outputs):
            h.update(str(graph.tensors[t].shape).encode())
    return h.hexdigest()[:16]


def _cluster(mesh: LogicalMesh) -> tuple[int, int]:
    if len(mesh.shape) == 1:
        return (1, mesh.shape[0])
    if len(mesh.shape) == 2:
        return (mesh.shape[0], mesh.shape[1])
    raise PipelineError(f"pipelines run on 1-D (devices) or 2-D (hosts x devices) meshes; got {mesh}")


def _submesh_cost(cost: CostModel, shape: tuple[int, int]) -> CostModel:
    """The cost model of a stage's submesh: (1, d) is a 1-D mesh over the mesh's inner axis name, (h, D)
    keeps both axes. Links are the cluster's (inside a host: fast; across hosts: slow)."""
    names = cost.mesh.axis_names
    if shape[0] == 1:
        sub_shape, sub_names = (shape[1],), (names[-1],)
    else:
        sub_shape, sub_names = shape, names
    links = cost.mesh.links
    link_of = dict(zip(names, links, strict=True))
    if shape[0] == 1:
        inner = link_of[names[-1]]
        mesh = LogicalMesh(axis_names=sub_names, shape=sub_shape, links=(inner,))
    else:
        mesh = LogicalMesh(axis_names=sub_names, shape=sub_shape, links=tuple(link_of[n] for n in sub_names))
    return dataclasses.replace(cost, mesh=mesh)


def _remap(plan: Plan, sub: Any) -> dict[Scope, dict[int, ShardingSpec]]:
    """A sub-graph plan's specs keyed by the step's op and tensor ids."""
    out: dict[Scope, dict[int, ShardingSpec]] = {}
    for scope, table in plan.specs.items():
        if scope == ():
            out[()] = {sub.tensors[t]: s for t, s in table.items()}
        else:
            (op, b), *rest = scope
            out[((sub.ops[op], b), *rest)] = dict(table)
    return out


def _signature(graph: Graph, ops: Sequence[int]) -> str:
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
class _Priced:
    time: float
    memory: float
    plan: Plan | None
    sub: Any


def _plan_ops(graph: Graph, ops: Sequence[int], cost: CostModel, hardware: str, budget: float | None,
              time_budget_s: float, activation_weight: float = 1.0) -> _Priced:
    """Plan some ops; ``memory`` is the plan's peak with activations counted ``activation_weight`` times."""
    if not ops:
        return _Priced(0.0, 0.0, None, None)
    sub = subgraph(graph, ops)
    try:
        plan = plan_graph(sub.graph, cost, hardware=hardware, memory_budget=budget, time_budget_s=time_budget_s,
                          activation_weight=activation_weight)
    except PlanError:
        return _Priced(math.inf, math.inf, None, sub)
    return _Priced(plan.predicted_step_time, plan.peak_memory, plan, sub)


def _reuse(graph: Graph, priced: _Priced, ops: Sequence[int]) -> _Priced | None:
    """The plan of an identical set of ops, carried over to ``ops`` (their sub-graphs number tensors the
    same way: inputs by first use, then results in schedule order); None if the numbering differs."""
    if priced.plan is None or not ops:
        return _Priced(priced.time, priced.memory, priced.plan, None)
    sub = subgraph(graph, ops)
    same = [(t.shape, t.dtype) for t in sub.graph.tensors] == [(t.shape, t.dtype) for t in priced.sub.graph.tensors]
    return _Priced(priced.time, priced.memory, priced.plan, sub) if same else None


# ---- the planner -----------------------------------------------------------------------------------------


def plan_pipeline(graph: Graph, cost: CostModel, *, hardware: str = "", memory_budget: float | None = None,
                  num_microbatches: int = 4, schedule_name: str = "1f1b", num_layers: int | None = None,
                  time_budget_s: float = 60.0, max_stages: int | None = None,
                  forced_boundaries: Sequence[int] = (), stage_shape: tuple[int, int] | None = None) -> PipelinePlan:
    """Plan ``graph`` (the step traced at microbatch size) as a pipeline on ``cost.mesh``; see the module
    docstring. ``num_layers`` defaults to one per block the scopes name, plus one
    (``partition.default_num_layers``); ``max_stages`` bounds the stage count; ``stage_shape`` =
    (hosts, devices) makes every stage that submesh (so ``devices / size`` stages)."""
    t_start = time.perf_counter()
    if schedule_name not in SCHEDULE_NAMES or schedule_name == "interleaved-1f1b":
        raise PipelineError(f"schedule {schedule_name!r}: the pipeline runtime runs 'gpipe' and '1f1b'")
    if num_microbatches < 1:
        raise PipelineError(f"num_microbatches must be >= 1, got {num_microbatches}")
    cluster = _cluster(cost.mesh)
    parts = split_step(graph)
    layer_of_op = assign_layers(graph, parts, num_layers, forced=forced_boundaries)
    L = max(layer_of_op) + 1
    submeshes = alpa_submeshes(cluster)
    if stage_shape is not None:
        stage_shape = (int(stage_shape[0]), int(stage_shape[1]))
        n = cluster[0] * cluster[1]
        if stage_shape not in submeshes or n % (stage_shape[0] * stage_shape[1]):
            raise PipelineError(f"stage_shape {stage_shape} is not one of the submesh shapes of the "
                                f"{cluster[0]}x{cluster[1]} cluster that tile it: {list(submeshes)}")
        submeshes = (stage_shape,)
    M = len(submeshes)
    sub_costs = {shape: _submesh_cost(cost, shape) for shape in submeshes}  # one per shape: they cache prices
    micro_ops: list[list[int]] = [[] for _ in range(L)]
    update_ops: list[list[int]] = [[] for _ in range(L)]
    for op in graph.ops:
        (update_ops if parts.kind[op.id] == UPDATE else micro_ops)[layer_of_op[op.id]].append(op.id)
    # bytes crossing into layer i (forward activations from earlier layers)
    fwd, _, cut = forward_sequence(graph, parts)
    into = np.zeros(L)
    for k in range(1, len(fwd)):
        a, b = layer_of_op[fwd[k - 1]], layer_of_op[fwd[k]]
        if b != a:
            into[b] = cut[k - 1]
    slow = min(link.bandwidth for link in cost.mesh.links)
    # ---- per-layer prices ----
    # A layer is priced under its share of a stage's memory: on submesh m the cluster holds about
    # N / n_m stages of L·n_m / N layers each, the first of which keeps the most microbatches in flight.
    # Its activations count that many times (so the intra-op plan picks layouts a full stage can hold);
    # a layer that cannot fit its share is priced again under the whole budget.
    signatures = [_signature(graph, micro_ops[ell]) + _signature(graph, update_ops[ell]) for ell in range(L)]
    distinct = len(set(signatures))
    share = 0.4 * time_budget_s / max(1, 2 * distinct * M)  # solver seconds per layer plan
    limit = max_stages or L
    inflight = inflight_rule(schedule_name, min(limit, L), num_microbatches)
    n_dev = cluster[0] * cluster[1]
    cache: dict[tuple[str, int], tuple[_Priced, _Priced, float]] = {}
    t_micro = np.zeros((L, M))
    m_micro = np.zeros((L, M))
    t_upd = np.zeros((L, M))
    m_upd = np.zeros((L, M))
    solves = 0
    for ell in range(L):
        for m, shape in enumerate(submeshes):
            key = (signatures[ell], m)
            if key not in cache:
                sub_cost = sub_costs[shape]
                stages_m = max(1, n_dev // (shape[0] * shape[1]))
                weight = float(inflight[min(stages_m, len(inflight)) - 1])
                layer_budget = None if memory_budget is None else memory_budget * min(1.0, stages_m / L)
                pu = _plan_ops(graph, update_ops[ell], sub_cost, hardware, layer_budget, share)
                if not math.isfinite(pu.time) and memory_budget is not None:
                    pu = _plan_ops(graph, update_ops[ell], sub_cost, hardware, memory_budget, share)
                micro_budget = None if layer_budget is None else layer_budget - pu.memory
                pm = _Priced(math.inf, math.inf, None, None)
                if micro_budget is None or micro_budget > 0:
                    pm = _plan_ops(graph, micro_ops[ell], sub_cost, hardware, micro_budget, share, weight)
                solves += 2
                if not math.isfinite(pm.time) and memory_budget is not None and math.isfinite(pu.memory):
                    pm = _plan_ops(graph, micro_ops[ell], sub_cost, hardware, memory_budget, share, weight)
                    solves += 1
                cache[key] = (pm, pu, weight)
            pm, pu, weight = cache[key]
            t_micro[ell, m], m_micro[ell, m] = pm.time, pm.memory / weight
            t_upd[ell, m], m_upd[ell, m] = pu.time, pu.memory
    stage_time = np.full((L, L, M), np.inf)
    static = np.zeros((L, L, M))
    act = np.zeros((L, L, M))
    for i in range(L):  # running sums (an infinite layer makes every range holding it infinite)
        t_run, s_run, a_run = np.zeros(M), np.zeros(M), np.zeros(M)
        for j in range(i, L):
            t_run, s_run, a_run = t_run + t_micro[j], s_run + m_upd[j], a_run + m_micro[j]
            stage_time[i, j] = t_run + 2 * into[i] / slow
            static[i, j] = s_run
            act[i, j] = a_run
    stage_time[~np.isfinite(stage_time)] = np.inf
    problem = InterOpProblem(num_layers=L, cluster=cluster, stage_time=stage_time,
                             num_microbatches=num_microbatches, submeshes=submeshes, static_memory=static,
                             activation_memory=act, memory_limit=memory_budget, inflight=inflight,
                             max_stages=min(limit, L))
    try:
        sol = solve_inter_op(problem)
    except InterOpInfeasibleError as e:
        raise PipelineError(f"no pipeline of {L} layers fits: {e}") from None
    t_dp = time.perf_counter() - t_start
    # ---- re-plan the chosen stages whole ----
    placement = sol.placement
    if placement is None:
        raise PipelineError(f"the chosen submeshes {sol.submesh_shapes(problem)} do not tile the cluster {cluster}")
    stages: list[StagePlan] = []
    S = len(sol.stages)
    stage_ops = []
    for st in sol.stages:
        layers = range(st.first_layer, st.last_layer + 1)
        stage_ops.append(([i for ell in layers for i in micro_ops[ell]],
                          [i for ell in layers for i in update_ops[ell]]))
    # identical stages (same ops on the same submesh shape) are planned once
    keys = [(_signature(graph, m) + _signature(graph, u), st.submesh, inflight[S - 1 - s])
            for s, ((m, u), st) in enumerate(zip(stage_ops, sol.stages, strict=True))]
    budget_each = max(1.0, 0.6 * time_budget_s / (2 * len(set(keys))))  # solver seconds per stage plan
    done: dict[Any, tuple[_Priced, _Priced]] = {}
    for s, st in enumerate(sol.stages):
        shape = submeshes[st.submesh]
        sub_cost = sub_costs[shape]
        mops, uops = stage_ops[s]
        hit = done.get(keys[s])
        reused = [_reuse(graph, p, ops) for p, ops in zip(hit, (mops, uops), strict=True)] if hit else [None]
        if None not in reused:
            pm, pu = reused
        else:
            # the stage's own budget: its update state once, its activations once per microbatch in flight
            pu = _plan_ops(graph, uops, sub_cost, hardware, memory_budget, budget_each)
            rest = None if memory_budget is None else memory_budget - pu.memory
            pm = _Priced(math.inf, math.inf, None, None)
            if rest is None or rest > 0:
                pm = _plan_ops(graph, mops, sub_cost, hardware, rest, budget_each, float(inflight[S - 1 - s]))
            done[keys[s]] = (pm, pu)
        if pm.plan is None and mops:
            raise PipelineError(f"stage {s} (layers {st.first_layer}..{st.last_layer}) on {shape} did not plan "
                                "within the memory budget when planned whole")
        stages.append(StagePlan(
            layers=(st.first_layer, st.last_layer), submesh=shape, origin=placement[s], mesh=sub_cost.mesh,
            micro_time=pm.time + 2 * into[st.first_layer] / slow, update_time=pu.time,
            memory=pu.memory + pm.memory,
            specs=_remap(pm.plan, pm.sub) if pm.plan else {},
            update_specs=_remap(pu.plan, pu.sub) if pu.plan else {},
        ))
    times = [st.micro_time for st in stages]
    B = num_microbatches
    pipe = sum(times) + (B - 1) * max(times)
    step_time = pipe + max(st.update_time for st in stages)
    bubble = 1.0 - sum(times) * B / (S * pipe) if pipe > 0 else 0.0
    return PipelinePlan(
        mesh=cost.mesh, hardware=hardware, num_microbatches=B, schedule=schedule_name, num_layers=L,
        stages=tuple(stages), layer_of_op=layer_of_op, predicted_step_time=step_time, bubble_fraction=bubble,
        peak_memory=max(st.memory for st in stages), memory_budget=memory_budget,
        solver={"dp_cost": sol.cost, "layer_solves": solves, "distinct_layers": len({k[0] for k in cache}),
                "dp_seconds": sol.stats.seconds, "dp_candidates": sol.stats.candidates,
                "stage_costing_seconds": t_dp, "planning_seconds": time.perf_counter() - t_start},
        graph_digest=graph_digest(graph),
    )


def microbatch_args(args: Sequence[Any], graph: Graph, parts: StepParts | None = None,
                    num_microbatches: int = 1) -> tuple[Any, ...]:
    """``args`` with every batch leaf cut to its first ``1/num_microbatches`` along dimension 0 (abstract
    leaves become ShapeDtypeStructs of that shape)."""
    import jax

    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    batch = parts.batch_inputs if parts is not None else tuple(
        i for i, t in enumerate(graph.inputs) if graph.tensors[t].role.value == "batch")
    out = list(leaves)
    for i in batch:
        x = leaves[i]
        n = x.shape[0]
        if n % num_microbatches:
            raise PipelineError(f"batch input {graph.tensors[graph.inputs[i]].name!r} has {n} rows, not divisible "
                                f"into {num_microbatches} microbatches; pick a microbatch count dividing {n}")
        k = n // num_microbatches
        out[i] = jax.ShapeDtypeStruct((k, *x.shape[1:]), x.dtype) if not hasattr(x, "__array__") or \
            isinstance(x, jax.ShapeDtypeStruct) else x[:k]
    return tuple(jax.tree_util.tree_unflatten(tree, out))
