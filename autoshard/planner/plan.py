"""The Plan: everything needed to run a sharded step, as plain data (JSON round-trip, ``verify()``).

``plan_graph`` builds the intra-operator problem (``autoshard.planner.build``), solves it
(``solvers.solve_intra_op``) and reads the solution back into layouts per tensor, a predicted step time
split by category, and the predicted peak memory per device. ``plan.solver`` also records the solver's
choice per node (``"choice"``, to answer why-questions later) and the op groups that cost the most
(``"top_ops"``). ``fixed=`` pins some inputs' layouts (a hand-written layout, ``autoshard.planner.manual``)
and lets the solver complete the rest. ``Plan.explain()`` and ``Plan.diff()`` read a plan for a person
(``autoshard.planner.explain``, ``autoshard.planner.compare``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autoshard.errors import AutoshardError
from autoshard.planner.build import BuiltProblem, Scope, build_problem
from autoshard.trace.graph import Graph
from cost_models import CostModel, LogicalMesh, ShardingSpec
from solvers import InfeasibleError, IntraOpProblem, IntraOpSolution, greedy_completion, solve_intra_op

if TYPE_CHECKING:
    from autoshard.planner.compare import PlanDiff

PLAN_VERSION = 1
TOP_OPS = 30  # op groups recorded per plan, costliest first


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

    # ---- reading ------------------------------------------------------------------------------------

    def explain(self, *, top: int = 10) -> str:
        """The plan for a person: layouts per parameter class and per layer, time by category, memory by
        kind, and where the time goes (``autoshard.planner.explain``)."""
        from autoshard.planner.explain import explain_plan

        return explain_plan(self, top=top).text()

    def diff(self, other: Plan) -> PlanDiff:
        """What changes from this plan to ``other``: layouts, time and memory by category."""
        from autoshard.planner.compare import diff_plans

        return diff_plans(self, other)

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
    return peak_memory_of(built, sol.choice)


def peak_memory_of(built: BuiltProblem, choice: np.ndarray) -> float:
    """Peak over the schedule of the summed bytes per device of the live nodes under ``choice``."""
    p = built.problem
    events: dict[int, float] = defaultdict(float)
    for i, node in enumerate(built.nodes):
        m = float(p.node_memory[i][choice[i]])
        start, end = node.interval
        if end > start and m:
            events[start] += m
            events[end] -= m
    cur = peak = 0.0
    for t in sorted(events):
        cur += events[t]
        peak = max(peak, cur)
    return peak


@dataclasses.dataclass(slots=True)
class ProblemCache:
    """The problems built for one graph, kept across several ``plan_graph`` calls on it (pricing hand-written
    layouts, ``compare``). Building is deterministic: a problem depends on the graph and the cost model's
    mesh and prices only; the memory budget is set per call."""

    graph: Graph
    _built: dict[Any, tuple[Any, BuiltProblem]] = dataclasses.field(default_factory=dict)

    def get(self, cost: CostModel, memory_budget: float | None, activation_weight: float = 1.0) -> BuiltProblem:
        key = (id(cost.profile), cost.mesh, activation_weight)
        hit = self._built.get(key)
        if hit is None or hit[0] is not cost.profile:
            hit = (cost.profile, build_problem(self.graph, cost, None, activation_weight=activation_weight))
            self._built[key] = hit
        built = hit[1]
        return dataclasses.replace(built, problem=dataclasses.replace(built.problem, memory_limit=memory_budget))


def _input_nodes(built: BuiltProblem) -> dict[int, int]:
    """Top-level input tensor id -> the node whose strategies are its layouts."""
    return {node.produces[0][0][0][1]: i for i, node in enumerate(built.nodes) if node.kind == "input"}


def _pin(graph: Graph, built: BuiltProblem, fixed: Mapping[int, ShardingSpec] | None, *,
         strict: bool = True) -> IntraOpProblem | None:
    """``built.problem`` with each input in ``fixed`` (tensor id -> layout) held at its layout: every other
    strategy of its node costs +inf. A layout the node does not have raises PlanError (``strict``) or
    gives None."""
    if not fixed:
        return built.problem
    costs = list(built.problem.node_costs)
    nodes = _input_nodes(built)
    mesh = None
    for tid, spec in fixed.items():
        i = nodes.get(tid)
        if i is None:
            continue  # an input nothing reads: its layout costs nothing either way
        node = built.nodes[i]
        specs = [node.produces[s][0][1] for s in range(node.k)]
        if spec not in specs:
            if not strict:
                return None
            t = graph.tensors[tid]
            mesh = mesh or _mesh_of(built, specs)
            raise PlanError(
                f"the layout {spec} given for {t.name} {list(t.shape)} is not one autoshard can express"
                f"{mesh}: a split dimension must divide evenly, at most two mesh axes split one dimension, "
                f"and they go in mesh order (major to minor). Layouts it has for this tensor: "
                + ", ".join(str(x) for x in specs[:12]) + (" ..." if len(specs) > 12 else "")
            )
        mask = np.full(node.k, math.inf)
        s = specs.index(spec)
        mask[s] = costs[i][s]
        costs[i] = mask
    return dataclasses.replace(built.problem, node_costs=costs)


def _mesh_of(built: BuiltProblem, specs: list[ShardingSpec]) -> str:
    axes = sorted({a for sp in specs for a in sp.sharded_axes})
    return f" (mesh axes {', '.join(axes)})" if axes else ""


def _single_axis_seeds(graph: Graph, cost: CostModel, memory_budget: float | None, built: BuiltProblem,
                       problem: IntraOpProblem, budget_s: float, fixed: Mapping[int, ShardingSpec] | None,
                       problems: ProblemCache) -> tuple[np.ndarray | None, dict[str, float]]:
    """On a mesh with several axes, plan once per axis with the others held at size 1 (a problem with a
    fraction of the strategies, which the ILP solves well) and return the best answer, mapped onto the
    full problem's strategies, as the full solve's starting point: the 2-D plan is then never worse
    than the best plan that uses one axis. With ``fixed`` layouts, an axis whose problem cannot hold them
    gives no seed. Returns (initial assignment or None, objective per axis)."""
    mesh = cost.mesh
    axes = [i for i, n in enumerate(mesh.shape) if n > 1]
    if len(axes) < 2 or budget_s < 0.5 or problem.num_nodes > GRID_START_MAX_NODES:
        return None, {}  # small budgets or big graphs: building the extra problems costs more than it gives
    share = budget_s / len(axes)
    deadline = time.perf_counter() + budget_s
    # inputs are all live at the start: an axis over which even the fully split inputs overflow the
    # budget cannot give a plan (checked before building its problem, which is not free on big graphs)
    inputs = sum(graph.tensors[t].nbytes for t in graph.inputs)
    best, best_obj, seeds = None, math.inf, {}
    for i in axes:
        if time.perf_counter() > deadline:
            break
        if memory_budget is not None and inputs / mesh.shape[i] > memory_budget:
            continue
        shape = tuple(n if j == i else 1 for j, n in enumerate(mesh.shape))
        sub = dataclasses.replace(cost, mesh=LogicalMesh(axis_names=mesh.axis_names, shape=shape, links=mesh.links))
        try:
            small = problems.get(sub, memory_budget, built.activation_weight)
            pinned = _pin(graph, small, fixed, strict=False)
            if pinned is None:
                continue
            sol = solve_intra_op(pinned, time_budget_s=share)
        except InfeasibleError:
            continue
        mapped = _map_choice(small, built, sol.choice)
        if mapped is None:
            continue
        obj = problem.cost_of(mapped)
        if not math.isfinite(obj):
            continue
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


_SCOPE_INDEX = re.compile(r"_\d+(?=[./]|$)")


def top_ops(built: BuiltProblem, choice: np.ndarray, n: int = TOP_OPS) -> list[dict[str, Any]]:
    """The op groups where the step's time goes under ``choice``, costliest first, as JSON-ready dicts.

    A node's time is its own cost (compute and collectives, times its trip count) plus the resharding on
    the edges into it (on an edge into an input node, the tie of returned state: charged to its producer).
    Nodes are folded by (primitive, name scope with layer indices as ``_*``, source line, phase), so the 24
    copies of one matmul in a 24-layer model are one entry with ``count`` 24."""
    p = built.problem
    res = np.zeros(len(built.nodes))
    for (u, v), mat in zip(p.edges.tolist(), p.edge_costs, strict=True):
        t = float(mat[choice[u], choice[v]])
        if t > 0:
            res[v if built.nodes[v].ops else u] += t
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    for i, node in enumerate(built.nodes):
        if not node.ops:
            continue
        s = int(choice[i])
        t = float(node.cost[s]) + float(res[i])
        if t <= 0:
            continue
        scope, op_id = node.ops[0]
        op = built.graphs[scope].ops[op_id]
        folded = _SCOPE_INDEX.sub("_*", op.scope)
        key = (op.primitive, folded, op.source, op.phase, node.kind)
        g = groups.get(key)
        if g is None:
            reads = ", ".join(str(spec) for _, spec in node.reads[s][:3])
            outs = ", ".join(str(spec) for _, spec in node.produces[s][:1])
            g = groups[key] = {
                "op": op.where(), "primitive": op.primitive, "scope": folded, "source": op.source,
                "phase": op.phase, "layout": f"{reads} -> {outs}", "count": 0, "time": 0.0, "compute": 0.0,
                "collectives": 0.0, "resharding": 0.0,
            }
        g["count"] += 1
        g["time"] += t
        g["compute"] += float(node.compute[s])
        g["collectives"] += float(node.comm[s])
        g["resharding"] += float(res[i])
    return sorted(groups.values(), key=lambda g: -g["time"])[:n]


def encode_choice(choice: np.ndarray) -> str:
    """The solver's strategy index per node, as recorded in ``plan.solver["choice"]``."""
    return " ".join(str(int(c)) for c in choice)


def decode_choice(text: str) -> np.ndarray:
    return np.array([int(c) for c in text.split()], dtype=np.int64)


def plan_graph(
    graph: Graph,
    cost: CostModel,
    *,
    hardware: str = "",
    memory_budget: float | None = None,
    time_budget_s: float = 60.0,
    fixed: Mapping[str, ShardingSpec] | None = None,
    problems: ProblemCache | None = None,
    activation_weight: float = 1.0,
    starts: Sequence[Any] = (),
) -> Plan:
    """Plan ``graph`` on ``cost.mesh``: build the problem, solve it, read the layouts back.

    ``fixed``: input tensor name -> layout, held as given while the solver places everything else (the
    best completion of a hand-written layout). ``problems``: reuse problems already built for ``graph``.
    ``activation_weight``: see ``build_problem`` (the peak memory reported counts activations that many
    times; a pipeline stage holds several microbatches' at once).
    ``starts``: other starting points for the solve, each a Plan of this graph (its recorded choice) or a
    hand layout (``manual.HandLayout`` or a mapping input name -> layout), which is completed first with
    the inputs pinned. The budget is shared equally by the hand layouts to complete and the final solve,
    which starts from the best of them and the single-axis seeds: the plan is then never worse than the
    best start. Windowed search cannot move a large plan from one global structure to another (say, from
    data parallel over one axis to data × tensor parallel over two), so textbook starts help there.
    """
    t0 = time.perf_counter()
    if problems is None:
        problems = ProblemCache(graph)
    pins = _fixed_ids(graph, fixed, cost.mesh)
    built = problems.get(cost, memory_budget, activation_weight)
    problem = _pin(graph, built, pins)
    assert problem is not None
    t_build = time.perf_counter() - t0
    try:
        t_start = time.perf_counter()
        started, start_costs, budget_s = _solve_starts(graph, cost, built, problem, starts, time_budget_s)
        initial, seeds = _single_axis_seeds(graph, cost, memory_budget, built, problem, 0.3 * budget_s,
                                            pins, problems)
        if started is not None and (initial is None or problem.cost_of(started) < problem.cost_of(initial)):
            initial = started
        grid_start, grid_costs = (None, {}) if pins else _grid_starts(graph, cost, built, problem,
                                                                        0.3 * budget_s)
        if grid_start is not None and (initial is None or problem.cost_of(grid_start) < problem.cost_of(initial)):
            initial = grid_start
        left = time_budget_s - (time.perf_counter() - t_start)
        sol = solve_intra_op(problem, time_budget_s=max(left, 0.2 * budget_s), initial=initial)
    except InfeasibleError as e:
        what = ("with the given inputs' layouts held fixed" if pins
                else "with any layout autoshard can express")
        raise PlanError(
            f"{e}\nThe step does not fit in {memory_budget:.3g} bytes per device on mesh {cost.mesh} {what}: "
            "use more devices, a smaller batch, recomputation (remat), or plan without a memory limit "
            "(memory_budget=None, --memory-budget none) to see what it would need."
        ) from None
    specs: dict[Scope, dict[int, ShardingSpec]] = defaultdict(dict)
    for i, node in enumerate(built.nodes):
        for (scope, tid), spec in node.produces[int(sol.choice[i])]:
            specs[scope][tid] = spec
    top = specs.get((), {})

    def layout(tid: int, name: str) -> TensorLayout:
        t = graph.tensors[tid]
        spec = top.get(tid, (pins or {}).get(tid, ShardingSpec.replicated(len(t.shape))))
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
    solver: dict[str, Any] = {
        "status": sol.status,
        "optimal": bool(sol.optimal),
        "objective": float(sol.cost),
        "lower_bound": None if sol.lower_bound is None else float(sol.lower_bound),
        "build_seconds": t_build,
        "single_axis_seeds": seeds,
        "grid_seeds": grid_costs,
        "solve_seconds": float(sol.solve_seconds),
        "nodes": built.problem.num_nodes,
        "edges": built.problem.num_edges,
        "strategies": int(built.problem.num_strategies.sum()),
        "top_ops": top_ops(built, sol.choice),
        "choice": encode_choice(sol.choice),
    }
    if pins:
        solver["fixed_inputs"] = len(pins)
    if start_costs:
        solver["starts"] = start_costs
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
        solver=solver,
        versions=_versions(),
    )
    plan.verify(graph)
    return plan


def _solve_starts(graph: Graph, cost: CostModel, built: BuiltProblem, problem: IntraOpProblem,
                  starts: Sequence[Any], time_budget_s: float) -> tuple[np.ndarray | None, dict[str, float], float]:
    """The best of ``starts`` (see ``plan_graph``) as an assignment of ``problem``, the objective of each,
    and the budget left for the final solve (an equal share)."""
    if not starts:
        return None, {}, time_budget_s
    layouts = [s for s in starts if not isinstance(s, Plan)]
    share = time_budget_s / (len(layouts) + 1)
    best, best_obj, costs = None, math.inf, {}
    k = problem.num_strategies
    for n, start in enumerate(starts):
        if isinstance(start, Plan):
            name = f"plan {n}"
            text = start.solver.get("choice")
            if not isinstance(text, str):
                continue
            choice = decode_choice(text)
            if len(choice) != len(k) or not bool(np.all(choice < k)):
                continue
        else:
            name = str(getattr(start, "name", f"layout {n}"))
            fixed = getattr(start, "specs", start)
            pinned = _pin(graph, built, _fixed_ids(graph, fixed, cost.mesh), strict=False)
            if pinned is None:
                continue
            try:
                choice = solve_intra_op(pinned, time_budget_s=share).choice
            except InfeasibleError:
                continue
        obj = problem.cost_of(choice)
        if built.problem.memory_limit is not None and peak_memory_of(built, choice) > built.problem.memory_limit:
            continue
        costs[name] = float(obj)
        if obj < best_obj:
            best, best_obj = choice, obj
    return best, costs, share


# Above this many nodes (GPT-3 15B and 39B unrolled: ~16k) building one-axis problems and ten greedy
# passes cost a good part of a 30 s budget and mostly give layouts that do not fit in memory: the budget
# goes to the final solve instead.
GRID_START_MAX_NODES = 12_000


def _grid_starts(graph: Graph, cost: CostModel, built: BuiltProblem, problem: IntraOpProblem,
                 budget_s: float, refine: int = 2) -> tuple[np.ndarray | None, dict[str, float]]:
    """Completions of the textbook layouts of ``manual.grid`` (data, ZeRO and tensor parallel per mesh
    axis): greedy propagation plus ICM sweeps for each (``solvers.greedy_completion``, one pass over the
    problem), then the ``refine`` best solved with their inputs pinned in ``budget_s`` seconds shared.
    The best that fits in memory hands the final solve a global structure its windowed search could not
    reach on its own. Returns (best assignment or None, objective per layout)."""
    from autoshard.planner import manual

    if all(n == 1 for n in cost.mesh.shape) or problem.num_nodes > GRID_START_MAX_NODES:
        return None, {}
    best, best_obj, costs = None, math.inf, {}
    found: list[tuple[float, str, IntraOpProblem, np.ndarray]] = []
    limit = built.problem.memory_limit
    deadline = time.perf_counter() + budget_s
    for layout in manual.grid(graph, cost.mesh):
        if time.perf_counter() > deadline - 0.5 * budget_s:  # half the share for the greedy passes
            break
        try:
            pinned = _pin(graph, built, _fixed_ids(graph, layout.specs, cost.mesh), strict=False)
        except PlanError:
            continue
        choice = None if pinned is None else greedy_completion(pinned)
        if choice is None:
            continue
        obj = problem.cost_of(choice)
        if not math.isfinite(obj) or (limit is not None and peak_memory_of(built, choice) > limit):
            continue
        costs[layout.name] = float(obj)
        found.append((float(obj), layout.name, pinned, choice))
        if obj < best_obj:
            best, best_obj = choice, obj
    found.sort(key=lambda f: f[0])
    left = deadline - time.perf_counter()
    top = found[:refine] if left >= 1.0 else []
    for _, name, pinned, choice in top:
        try:
            sol = solve_intra_op(pinned, time_budget_s=left / len(top), initial=choice)
        except InfeasibleError:
            continue
        obj = problem.cost_of(sol.choice)
        if limit is not None and peak_memory_of(built, sol.choice) > limit:
            continue
        costs[name] = min(costs[name], float(obj))
        if obj < best_obj:
            best, best_obj = sol.choice, obj
    return best, costs


def _fixed_ids(graph: Graph, fixed: Mapping[str, ShardingSpec] | None, mesh: LogicalMesh) -> dict[int, ShardingSpec]:
    """Input names -> tensor ids, each layout checked against its tensor and the mesh."""
    if not fixed:
        return {}
    by_name = {graph.tensors[t].name: t for t in graph.inputs}
    out = {}
    for name, spec in fixed.items():
        tid = by_name.get(name)
        if tid is None:
            close = [n for n in by_name if n.endswith(name.rsplit(".", 1)[-1])][:5]
            raise PlanError(f"a fixed layout names {name!r}, which is not an input of the step"
                            + (f"; inputs with that ending: {', '.join(close)}" if close else ""))
        t = graph.tensors[tid]
        try:
            spec.validate(t.shape, mesh, require_divisible=True)
        except ValueError as e:
            raise PlanError(f"fixed layout of {name} {list(t.shape)}: {e}") from None
        if spec.partial:
            raise PlanError(f"fixed layout of {name}: {spec} has pending partial sums; an input holds whole values")
        out[tid] = spec
    return out
