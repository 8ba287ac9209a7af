"""The Plan: everything needed to run a sharded step, as plain data (JSON round-trip, ``verify()``).

``plan_graph`` builds the intra-operator problem (``autoshard.planner.build``), solves it
(``solvers.solve_intra_op``) and reads the solution back into layouts per tensor, a predicted step time
split by category, and the predicted peak memory per device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from autoshard.errors import AutoshardError
from autoshard.planner.build import BuiltProblem, Scope, build_problem
from autoshard.trace.graph import Graph
from cost_models import CostModel, LogicalMesh, ShardingSpec
from solvers import InfeasibleError, IntraOpSolution, solve_intra_op

PLAN_VERSION = 1


class PlanError(AutoshardError, ValueError):
    """A plan that does not fit its graph or mesh, or a file that is not a plan."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorLayout:
    """The layout of one input or output leaf of the step."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    spec: ShardingSpec


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    mesh: LogicalMesh
    hardware: str
    memory_budget: float | None
    inputs: tuple[TensorLayout, ...]
    outputs: tuple[TensorLayout, ...]
    # scope (path of (op id, body index)) -> tensor id -> layout, for every tensor the solver placed
    specs: Mapping[Scope, Mapping[int, ShardingSpec]]
    # seconds: "compute"; one entry per collective kind and mesh axes, "all_reduce(data)", counting both
    # the ops' own collectives and those on resharding edges; "resharding": the part of the collectives
    # spent on edges (already inside the per-collective entries, so not added again).
    time_breakdown: Mapping[str, float]
    predicted_step_time: float
    peak_memory: float  # bytes per device
    solver: Mapping[str, Any]
    versions: Mapping[str, str]

    # ---- checks ------------------------------------------------------------------------------------

    def verify(self, graph: Graph | None = None) -> None:
        """Every spec names mesh axes, fits its tensor's rank and splits only divisible dimensions; with a
        graph, the plan's inputs and outputs are the graph's."""
        for t in (*self.inputs, *self.outputs):
            try:
                t.spec.validate(t.shape, self.mesh, require_divisible=True)
            except ValueError as e:
                raise PlanError(f"plan layout of {t.name} {list(t.shape)}: {e}") from None
        if not math.isfinite(self.predicted_step_time) or self.predicted_step_time < 0:
            raise PlanError(f"predicted step time {self.predicted_step_time} is not a finite, non-negative time")
        if graph is None:
            return
        names = [graph.tensors[i].name for i in graph.inputs]
        if names != [t.name for t in self.inputs]:
            raise PlanError("the plan's inputs are not this graph's inputs: plan another step, or retrace")
        for scope, table in self.specs.items():
            g = graph
            for op_id, b in scope:
                g = g.ops[op_id].bodies[b]
            for tid, spec in table.items():
                t = g.tensors[tid]
                try:
                    spec.validate(t.shape, self.mesh, require_divisible=True)
                except ValueError as e:
                    raise PlanError(f"plan layout of {t.name} {list(t.shape)}: {e}") from None

    # ---- JSON --------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def layout(t: TensorLayout) -> dict[str, Any]:
            return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "role": t.role,
                    "spec": str(t.spec)}

        return {
            "version": PLAN_VERSION,
            "mesh": self.mesh.to_dict(),
            "hardware": self.hardware,
            "memory_budget": self.memory_budget,
            "inputs": [layout(t) for t in self.inputs],
            "outputs": [layout(t) for t in self.outputs],
            "specs": [
                {"scope": [list(p) for p in scope], "tensors": {str(k): str(v) for k, v in sorted(table.items())}}
                for scope, table in self.specs.items()
            ],
            "time_breakdown": dict(self.time_breakdown),
            "predicted_step_time": self.predicted_step_time,
            "peak_memory": self.peak_memory,
            "solver": dict(self.solver),
            "versions": dict(self.versions),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"plan format version {d.get('version')!r}; this autoshard reads version {PLAN_VERSION}")

        def layout(x: Mapping[str, Any]) -> TensorLayout:
            return TensorLayout(name=x["name"], shape=tuple(x["shape"]), dtype=x["dtype"], role=x["role"],
                                spec=ShardingSpec.parse(x["spec"]))

        return cls(
            mesh=LogicalMesh.from_dict(d["mesh"]),
            hardware=d["hardware"],
            memory_budget=d["memory_budget"],
            inputs=tuple(layout(x) for x in d["inputs"]),
            outputs=tuple(layout(x) for x in d["outputs"]),
            specs={
                tuple(tuple(p) for p in e["scope"]): {int(k): ShardingSpec.parse(v) for k, v in e["tensors"].items()}
                for e in d["specs"]
            },
            time_breakdown=dict(d["time_breakdown"]),
            predicted_step_time=float(d["predicted_step_time"]),
            peak_memory=float(d["peak_memory"]),
            solver=dict(d["solver"]),
            versions=dict(d["versions"]),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise PlanError(f"{path} is not an autoshard plan ({type(e).__name__}: {e})") from None


def _versions() -> dict[str, str]:
    import jax

    import autoshard

    return {"autoshard": autoshard.__version__, "jax": jax.__version__}


def _breakdown(built: BuiltProblem, sol: IntraOpSolution, cost: CostModel) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for i, node in enumerate(built.nodes):
        s = int(sol.choice[i])
        out["compute"] += float(node.compute[s])
        st = node.strategies[s]
        if st is not None:
            for c in st.comm:
                out[f"{c.kind}({','.join(c.axes)})"] += c.time * node.weight
    p = built.problem
    for (u, v), mat, e in zip(p.edges, p.edge_costs, built.edges, strict=True):
        t = float(mat[sol.choice[u], sol.choice[v]])
        if t <= 0:
            continue
        out["resharding"] += t
        g = built.graphs[e.tensor[0]]
        tensor = g.tensors[e.tensor[1]]
        src = built.nodes[u].produced(e.tensor, int(sol.choice[u]))
        s_v = int(sol.choice[v])
        dst = built.nodes[v].needed(e.target, s_v) if e.kind == "data" else built.nodes[v].produced(e.target, s_v)
        if src is not None and dst is not None:
            for step in cost.reshard(tensor.shape, tensor.dtype, src, dst).steps:
                out[f"{step.kind}({','.join(step.axes)})"] += step.time * e.weight
    g = built.graphs[()]
    results = {((), t) for t in g.outputs}
    for i, node in enumerate(built.nodes):  # pending sums reduced as the step returns them
        for key, spec in node.produces[int(sol.choice[i])]:
            if key in results and spec.partial:
                results.discard(key)
                t = g.tensors[key[1]]
                for step in cost.reshard(t.shape, t.dtype, spec, ShardingSpec(dims=spec.dims)).steps:
                    out[f"{step.kind}({','.join(step.axes)})"] += step.time
    return dict(out)


def _peak_memory(built: BuiltProblem, sol: IntraOpSolution) -> float:
    p = built.problem
    events: dict[int, float] = defaultdict(float)
    for i, node in enumerate(built.nodes):
        m = float(p.node_memory[i][sol.choice[i]])
        start, end = node.interval
        if end > start and m:
            events[start] += m
            events[end] -= m
    cur = peak = 0.0
    for t in sorted(events):
        cur += events[t]
        peak = max(peak, cur)
    return peak


def _single_axis_seeds(graph: Graph, cost: CostModel, memory_budget: float | None, built: BuiltProblem,
                       budget_s: float) -> tuple[np.ndarray | None, dict[str, float]]:
    """On a mesh with several axes, plan once per axis with the others held at size 1 (a problem with a
    fraction of the strategies, which the ILP solves well) and return the best answer, mapped onto the
    full problem's strategies, as the full solve's starting point: the 2-D plan is then never worse
    than the best plan that uses one axis. Returns (initial assignment or None, objective per axis)."""
    mesh = cost.mesh
    axes = [i for i, n in enumerate(mesh.shape) if n > 1]
    if len(axes) < 2 or budget_s <= 0:
        return None, {}
    share = budget_s / len(axes)
    best, best_obj, seeds = None, math.inf, {}
    for i in axes:
        shape = tuple(n if j == i else 1 for j, n in enumerate(mesh.shape))
        sub = dataclasses.replace(cost, mesh=LogicalMesh(axis_names=mesh.axis_names, shape=shape, links=mesh.links))
        try:
            small = build_problem(graph, sub, memory_budget)
            sol = solve_intra_op(small.problem, time_budget_s=share)
        except InfeasibleError:
            continue
        mapped = _map_choice(small, built, sol.choice)
        if mapped is None:
            continue
        obj = built.problem.cost_of(mapped)
        seeds[mesh.axis_names[i]] = float(obj)
        if obj < best_obj:
            best, best_obj = mapped, obj
    return best, seeds


def _map_choice(small: BuiltProblem, full: BuiltProblem, choice: np.ndarray) -> np.ndarray | None:
    """``choice`` of ``small`` as strategy indices of ``full`` (same graph, strategies matched by the
    layouts they read and produce); None when the two problems' nodes do not line up."""
    if len(small.nodes) != len(full.nodes):
        return None
    out = np.empty(len(full.nodes), dtype=np.int64)
    for i, (a, b) in enumerate(zip(small.nodes, full.nodes, strict=True)):
        if a.name != b.name or a.ops != b.ops:
            return None
        s = int(choice[i])
        want = (tuple(a.produces[s]), tuple(a.reads[s]))
        for t in range(b.k):
            if (tuple(b.produces[t]), tuple(b.reads[t])) == want:
                out[i] = t
                break
        else:
            return None
    return out


def plan_graph(
    graph: Graph,
    cost: CostModel,
    *,
    hardware: str = "",
    memory_budget: float | None = None,
    time_budget_s: float = 60.0,
) -> Plan:
    """Plan ``graph`` on ``cost.mesh``: build the problem, solve it, read the layouts back."""
    t0 = time.perf_counter()
    built = build_problem(graph, cost, memory_budget)
    t_build = time.perf_counter() - t0
    try:
        initial, seeds = _single_axis_seeds(graph, cost, memory_budget, built, 0.3 * time_budget_s)
        left = time_budget_s - (time.perf_counter() - t0 - t_build)
        sol = solve_intra_op(built.problem, time_budget_s=max(left, 0.2 * time_budget_s), initial=initial)
    except InfeasibleError as e:
        raise PlanError(
            f"{e}\nThe step does not fit in {memory_budget:.3g} bytes per device on mesh {cost.mesh} with any "
            "layout autoshard can express: use more devices, a smaller batch, recomputation (remat), or plan "
            "without a memory limit (memory_budget=None, --memory-budget none) to see what it would need."
        ) from None
    specs: dict[Scope, dict[int, ShardingSpec]] = defaultdict(dict)
    for i, node in enumerate(built.nodes):
        for (scope, tid), spec in node.produces[int(sol.choice[i])]:
            specs[scope][tid] = spec
    top = specs.get((), {})

    def layout(tid: int, name: str) -> TensorLayout:
        t = graph.tensors[tid]
        spec = top.get(tid, ShardingSpec.replicated(len(t.shape)))
        spec = ShardingSpec(dims=spec.dims)  # inputs and outputs are materialised: no pending sums
        return TensorLayout(name=name, shape=t.shape, dtype=t.dtype, role=t.role.value, spec=spec)

    inputs = tuple(layout(tid, graph.tensors[tid].name) for tid in graph.inputs)
    outputs = []
    for o, tid in enumerate(graph.outputs):
        i = graph.output_aliases.get(o)
        lay = layout(tid, graph.output_names[o])
        if i is not None:  # returned train state goes back in the layout it came in (the tie edge's price)
            lay = dataclasses.replace(lay, spec=inputs[i].spec)
            specs[()][tid] = inputs[i].spec
        outputs.append(lay)
    breakdown = _breakdown(built, sol, cost)
    plan = Plan(
        mesh=cost.mesh,
        hardware=hardware,
        memory_budget=memory_budget,
        inputs=inputs,
        outputs=tuple(outputs),
        specs={k: dict(v) for k, v in specs.items()},
        time_breakdown=breakdown,
        predicted_step_time=math.fsum(v for k, v in breakdown.items() if k != "resharding"),
        peak_memory=_peak_memory(built, sol),
        solver={
            "status": sol.status,
            "optimal": bool(sol.optimal),
            "objective": float(sol.cost),
            "lower_bound": None if sol.lower_bound is None else float(sol.lower_bound),
            "build_seconds": t_build,
            "single_axis_seeds": seeds,
            "solve_seconds": float(sol.solve_seconds),
            "nodes": built.problem.num_nodes,
            "edges": built.problem.num_edges,
        },
        versions=_versions(),
    )
    plan.verify(graph)
    return plan
