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

import contextlib
import dataclasses
import gc
import json
import math
import re
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autoshard.errors import AutoshardError
from autoshard.planner.build import BuiltProblem, Scope, build_problem
from autoshard.trace.graph import Graph
from cost_models import CostModel, LogicalMesh, ShardingSpec
from solvers import InfeasibleError, IntraOpProblem, IntraOpSolution, equivalence_classes, solve_intra_op

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
    the inputs pinned.

    On graphs of ``SEED_MIN_NODES`` nodes or more, ``SEED_SHARE`` of the budget goes to seeds (``_seeds``:
    the best uniform plan over repeated blocks and the completions of the textbook layouts), the rest to
    the final solve, which starts from the best seed or start: the plan is never worse than any of them.
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
        with _gc_frozen():
            t_start = time.perf_counter()
            seeds = _seeds(graph, cost, built, problem, pins, starts, SEED_SHARE * time_budget_s)
            best = min(seeds, key=lambda x: x.objective, default=None)
            left = time_budget_s - (time.perf_counter() - t_start)
            sol = solve_intra_op(problem, time_budget_s=max(left, (1 - SEED_SHARE) * time_budget_s),
                                 initial=None if best is None else best.choice)
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
        "seeds": {x.name: float(x.objective) for x in seeds if not x.given},
        "solve_seconds": float(sol.solve_seconds),
        "nodes": built.problem.num_nodes,
        "edges": built.problem.num_edges,
        "strategies": int(built.problem.num_strategies.sum()),
        "top_ops": top_ops(built, sol.choice),
        "choice": encode_choice(sol.choice),
    }
    if pins:
        solver["fixed_inputs"] = len(pins)
    if starts:
        solver["starts"] = {x.name: float(x.objective) for x in seeds if x.given}
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


# Below this many nodes the final solve alone is as good (small cores are solved exactly): no seeds.
SEED_MIN_NODES = 500
SEED_SHARE = 0.6  # of the time budget, for the seeds; the final solve gets the rest
FIRST_ROUND_SHARE = 0.6  # of the seed budget, for the first round (one short solve per seed)
SECOND_ROUND = 2  # best seeds of the first round solved again with their layouts unpinned


@dataclasses.dataclass(frozen=True, slots=True)
class _Seed:
    name: str
    choice: np.ndarray
    objective: float
    given: bool  # one of the user's starts (recorded as ``solver["starts"]``), else automatic


def _seeds(graph: Graph, cost: CostModel, built: BuiltProblem, problem: IntraOpProblem,
           pins: Mapping[int, ShardingSpec], starts: Sequence[Any], budget_s: float) -> list[_Seed]:
    """Starting points for the final solve, each a memory-feasible assignment of ``problem``.

    Windowed search cannot move a large plan from one global structure to another (say, from data
    parallel over one axis to data × tensor parallel over two), so the final solve starts from the best
    of these. Every seed is solved *tied*: the copies of a repeated block (``solvers.equivalence_classes``)
    take one choice, which makes a transformer's problem 20-50 times smaller (``solve_intra_op(ties=)``).

    First round, ``FIRST_ROUND_SHARE`` of ``budget_s`` shared equally:

    * ``tied``: the tied problem on its own;
    * with no inputs pinned, one per textbook layout of ``manual.grid`` (data, ZeRO and tensor parallel
      per mesh axis): the tied problem with the layout's inputs pinned;
    * the user's ``starts``: a Plan of this graph (its recorded choice) as is, a hand layout (a
      ``manual.HandLayout`` or a mapping input name -> layout) like the grid's.

    Second round, the rest of ``budget_s``: the tied problem again, with no inputs pinned beyond ``pins``,
    started from each of the ``SECOND_ROUND`` best of the first round (``tied, from <name>``): a layout's
    global structure, with every tensor free to leave it (a ZeRO-sharded optimizer state here, a
    replicated bias there), uniformly over the blocks. Graphs under ``SEED_MIN_NODES`` nodes get only the
    user's starts, in one round. Measured on GPT-6.7B over 8x8 (30 s budget): the best layout's first-round
    seed costs 231 ms, its second-round seed 225 ms, the final untied solve from it 222 ms."""
    from autoshard.planner import manual

    if problem.num_nodes < SEED_MIN_NODES and not starts:
        return []
    start = time.perf_counter()
    classes = equivalence_classes(problem)
    limit = built.problem.memory_limit
    layouts: list[tuple[str, Mapping[str, ShardingSpec], bool]] = []
    out: list[_Seed] = []
    for n, user in enumerate(starts):
        if not isinstance(user, Plan):
            layouts.append((str(getattr(user, "name", f"layout {n}")), getattr(user, "specs", user), True))
            continue
        text = user.solver.get("choice")
        if not isinstance(text, str):
            continue
        choice = decode_choice(text)
        if len(choice) != problem.num_nodes or not bool(np.all(choice < problem.num_strategies)):
            continue
        objective = problem.cost_of(choice)  # a plan made under other pins or another budget may not do
        fits = limit is None or peak_memory_of(built, choice) <= limit * (1 + 1e-9)
        if math.isfinite(objective) and fits:
            out.append(_Seed(f"plan {n}", choice, objective, True))
    automatic = problem.num_nodes >= SEED_MIN_NODES and cost.mesh.num_devices > 1
    if automatic and not pins:
        layouts += [(lay.name, lay.specs, False) for lay in manual.grid(graph, cost.mesh)]
    jobs: list[tuple[str, IntraOpProblem | None, bool]] = [("tied", problem, False)] if automatic else []
    for name, specs, given in layouts:
        try:
            pinned = _pin(graph, built, {**_fixed_ids(graph, specs, cost.mesh), **pins}, strict=False)
        except PlanError:
            continue  # a layout that does not fit the tensors (a grid layout over an axis that divides nothing)
        jobs.append((name, pinned, given))
    second = automatic and len(jobs) > 1
    deadline = start + (FIRST_ROUND_SHARE if second else 1.0) * budget_s
    for n, (name, pinned, given) in enumerate(jobs):
        # what is left of the round, shared by the jobs left: a job that overran costs them all
        seconds = (deadline - time.perf_counter()) / (len(jobs) - n)
        seed = None if pinned is None or seconds <= 0.05 else _tied(name, pinned, classes, seconds, given)
        if seed is not None:
            out.append(seed)
    if not second:
        return out
    top = sorted(out, key=lambda x: x.objective)[:SECOND_ROUND]
    for n, best in enumerate(top):
        seconds = (start + budget_s - time.perf_counter()) / (len(top) - n)
        seed = None if seconds <= 0.05 else _tied(f"tied, from {best.name}", problem, classes, seconds, False,
                                                  initial=best.choice)
        if seed is not None:
            out.append(seed)
    return out


def _tied(name: str, problem: IntraOpProblem, classes: np.ndarray, seconds: float, given: bool,
          initial: np.ndarray | None = None) -> _Seed | None:
    """``problem`` solved with ``classes`` tied, as a seed; None if no tied assignment was found. The
    solver's answers are verified within ``problem``'s costs and memory limit: no check needed here."""
    try:
        sol = solve_intra_op(problem, time_budget_s=seconds, ties=_split(classes, problem), initial=initial)
    except InfeasibleError:
        return None  # tied, or with these inputs pinned, nothing fits
    return _Seed(name, sol.choice, sol.cost, given) if sol.feasible and math.isfinite(sol.cost) else None


@contextlib.contextmanager
def _gc_frozen() -> Iterator[None]:
    """Exempt the objects alive now (the traced graph, the built problem: millions on a large model) from
    the garbage collector's full collections while the solver runs. Each full collection walks all of
    them, about 0.5 s on GPT-6.7B, and the solver allocates enough to set one off every few hundred
    milliseconds; the objects it makes are still collected as usual."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _split(classes: np.ndarray, problem: IntraOpProblem) -> np.ndarray:
    """``classes`` refined so that the members of a class have the same costs in ``problem`` (pinned
    inputs: copies pinned to different layouts are not tied)."""
    keys = {}
    out = np.empty_like(classes)
    for i, c in enumerate(classes.tolist()):
        out[i] = keys.setdefault((c, problem.node_costs[i].tobytes()), len(keys))
    return out


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
