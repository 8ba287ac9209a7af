"""Plans explain themselves: what a plan chose, what it costs by category, and why.

``explain_plan(plan)`` reads a Plan alone (no graph needed):

- the layouts of the step's inputs per parameter class (layer indices folded, ``block_*``) and per layer
  (runs of layers with identical layouts folded into one line);
- the predicted step time split into compute, each collective kind per mesh axes (``all_reduce(x)``) and,
  as a part of the collectives, resharding between ops; the entries add up to the step time;
- memory per device split into parameters, optimizer state, gradients, batch and other state, and
  activations; see ``memory_breakdown`` for what is measured and what is estimated;
- the op groups where the time goes (recorded at planning time in ``plan.solver.top_ops``), each with
  its op, source line, phase, and how many layers share it.

``explain_tensor(graph, plan, cost, name)`` answers "why this layout?" for one tensor: it rebuilds the
solver problem (deterministic for the same graph, cost model and budget), reads the plan's choice back
(``plan.solver.choice``, or the specs mapped onto strategies for older plans), and for the node that
produces the tensor prices every strategy it had with its neighbours held at the plan's choice: its own
time (compute and collectives), the resharding on every edge it touches, and the memory it would need.
With ``resolve=True`` each alternative is also forced and the rest re-solved: the step time the best plan
with that choice would have had.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.planner.build import MEMORY_TIE_BREAK, BuiltProblem, TensorKey
from autoshard.planner.plan import Plan, PlanError, TensorLayout, decode_choice
from autoshard.planner.planning import ProblemCache
from autoshard.planner.readback import breakdown, peak_memory_of, step_time_of, step_time_of_breakdown
from autoshard.planner.summary import fold_layer_indices, human_time, input_class, layer_index, rewrite_lines
from autoshard.target import cost_model_for
from autoshard.trace.graph import Graph
from autoshard.trace.summary import human_bytes
from cost_models import CostModel, LogicalMesh, dtype_bytes
from solvers import InfeasibleError, solve_intra_op

_OP_ID = re.compile(r"\w+ \(op \d+\)")
GRADIENTS_NOTE = ("gradients: estimated as one gradient per parameter, in the parameter's dtype and layout,\n"
                  "   all live at once (the solver places gradients freely; this is the usual upper bound)")
ACTIVATIONS_NOTE = ("activations and temporaries: estimated as the predicted peak less the other rows\n"
                    "   (so they absorb any error of the gradient estimate)")


# ---- memory ------------------------------------------------------------------------------------------


def layout_bytes(t: TensorLayout, mesh: LogicalMesh) -> float:
    """Bytes per device of one input or output of the step in its plan layout."""
    return math.prod(t.shape) * dtype_bytes(t.dtype) / max(1, t.spec.num_shards(mesh))


def memory_breakdown(plan: Plan) -> dict[str, float]:
    """Bytes per device by kind. Parameters, optimizer state, batch and other state are exact (their
    layouts are in the plan); gradients and activations are estimates (``GRADIENTS_NOTE``,
    ``ACTIVATIONS_NOTE``). The rows add up to ``plan.peak_memory`` unless the estimates exceed it, in
    which case activations are 0."""
    by_role: dict[str, float] = defaultdict(float)
    for t in plan.inputs:
        by_role[t.role] += layout_bytes(t, plan.mesh)
    params = by_role.get("param", 0.0)
    out = {
        "parameters": params,
        "optimizer state": by_role.get("opt_state", 0.0),
        "gradients (estimate)": params,
        "batch": by_role.get("batch", 0.0),
        "other state": sum(v for k, v in by_role.items() if k not in ("param", "opt_state", "batch")),
    }
    out["activations (estimate)"] = max(0.0, plan.peak_memory - sum(out.values()))
    return out


# ---- layouts per class and per layer ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClassLayout:
    """The inputs of one class (name with layer indices folded) and the layouts they got, with counts."""

    role: str
    name: str
    shape: tuple[int, ...]
    specs: Mapping[str, int]

    @property
    def spec(self) -> str:
        """The most common layout of the class."""
        return max(self.specs.items(), key=lambda kv: kv[1])[0]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LayerLayouts:
    """A run of layers (``block_3``, ``block_4``...) whose parameters have identical layouts."""

    layers: tuple[str, ...]
    specs: tuple[tuple[str, str], ...]  # (name inside the layer, layout)

    @property
    def label(self) -> str:
        if len(self.layers) == 1:
            return self.layers[0]
        return f"{self.layers[0]}..{self.layers[-1]} ({len(self.layers)} layers)"


def class_layouts(plan: Plan) -> list[ClassLayout]:
    classes: dict[tuple[str, str, tuple[int, ...]], Counter[str]] = {}
    for t in plan.inputs:
        classes.setdefault((t.role, input_class(t), t.shape), Counter())[str(t.spec)] += 1
    rows = sorted(classes.items(), key=lambda kv: (kv[0][0] != "param", kv[0][0], kv[0][1]))
    return [ClassLayout(role=r, name=n, shape=s, specs=dict(c)) for (r, n, s), c in rows]


def _layer_split(names: Sequence[str]) -> Callable[[str], tuple[str, str] | None]:
    """How ``layer_layouts`` cuts a parameter's name into its layer and the name inside it:
    ``state.params.block_3.mlp.fc.kernel`` -> (``block_3``, ``mlp.fc.kernel``), ``...layers['3'].mlp...``
    -> (``layers['3']``, ...); None outside layers. The layer is the first indexed component whose index
    differs between the parameters (an nnx state's ``state[0]``, the same for every parameter, is not one)."""
    def parts(name: str) -> list[str]:
        head, sep, rest = name.partition("params.")
        return (rest if sep else head).split(".")

    seen: dict[str, set[int]] = defaultdict(set)
    for name in names:
        p = parts(name)
        for i, part in enumerate(p[:-1]):
            if (k := layer_index(part)) is not None:
                seen[fold_layer_indices(".".join(p[: i + 1]))].add(k)

    def split(name: str) -> tuple[str, str] | None:
        p = parts(name)
        for i, part in enumerate(p[:-1]):
            if layer_index(part) is not None and len(seen[fold_layer_indices(".".join(p[: i + 1]))]) > 1:
                return ".".join(p[: i + 1]), ".".join(p[i + 1:])
        return None

    return split


def layer_layouts(plan: Plan) -> list[LayerLayouts]:
    """Per layer, the layouts of its parameters; consecutive layers with the same layouts are folded."""
    layers: dict[str, list[tuple[str, str]]] = defaultdict(list)
    params = [t for t in plan.inputs if t.role == "param"]
    split_layer = _layer_split([t.name for t in params])
    for t in params:
        split = split_layer(t.name)
        if split is not None:
            layers[split[0]].append((split[1], str(t.spec)))

    def order(layer: str) -> tuple[str, int]:
        index = layer_index(layer)
        return (fold_layer_indices(layer), -1 if index is None else index)

    out: list[LayerLayouts] = []
    for layer in sorted(layers, key=order):
        specs = tuple(sorted(layers[layer]))
        prev = out[-1] if out else None
        if prev is not None and prev.specs == specs and order(prev.layers[-1])[0] == order(layer)[0]:
            out[-1] = LayerLayouts(layers=(*prev.layers, layer), specs=specs)
        else:
            out.append(LayerLayouts(layers=(layer,), specs=specs))
    return out


# ---- the whole plan ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Explanation:
    """What ``explain_plan`` found; ``text()`` renders it."""

    mesh: str
    hardware: str
    step_time: float
    time: tuple[tuple[str, float], ...]  # categories adding up to step_time, largest first
    resharding: float  # the part of the collectives spent between ops (inside the rows above)
    peak_memory: float
    memory_budget: float | None
    memory: tuple[tuple[str, float], ...]
    classes: tuple[ClassLayout, ...]
    layers: tuple[LayerLayouts, ...]
    top_ops: tuple[Mapping[str, Any], ...]
    solver: str
    rewrites: tuple[str, ...] = ()  # the planned step beside the step as written (``summary.rewrite_lines``)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self, *, max_classes: int = 60) -> str:
        budget = f" of a {human_bytes(self.memory_budget)} budget" if self.memory_budget else " (no budget)"
        lines = [f"mesh {self.mesh}   hardware {self.hardware or '?'}",
                 f"predicted step time {human_time(self.step_time)}   peak memory per device "
                 f"{human_bytes(self.peak_memory)}{budget}", *self.rewrites, "",
                 "time by category (adds up to the step time)"]
        total = self.step_time or 1.0
        for k, v in self.time:
            lines.append(f"  {k:<28} {human_time(v):>12}  {100 * v / total:5.1f}%")
        if self.resharding:
            lines.append(f"  of the collectives, resharding between ops: {human_time(self.resharding)} "
                         f"({100 * self.resharding / total:.1f}% of the step)")
        lines += ["", "memory per device"]
        for k, v in self.memory:
            lines.append(f"  {k:<28} {human_bytes(v):>12}")
        lines += [f"  {GRADIENTS_NOTE}", f"  {ACTIVATIONS_NOTE}"]
        lines += ["", "layouts per class (layer indices folded; xN: how many tensors)"]
        for c in self.classes[:max_classes]:
            specs = ", ".join(f"{s}" + (f" x{n}" if n > 1 else "") for s, n in c.specs.items())
            lines.append(f"  {c.role:<9} {c.name:<56} {list(c.shape)!s:<18} {specs}")
        if len(self.classes) > max_classes:
            lines.append(f"  ... {len(self.classes) - max_classes} more classes")
        if self.layers:
            lines += ["", "parameter layouts per layer (runs of identical layers folded)"]
            for group in self.layers:
                lines.append(f"  {group.label}")
                for name, spec in group.specs:
                    lines.append(f"      {name:<40} {spec}")
        if self.top_ops:
            lines += ["", f"where the time goes (top {len(self.top_ops)} op groups; xN: the ops that share the "
                      "source line, phase and scope, layers folded)"]
            for n, g in enumerate(self.top_ops, 1):
                count = f" x{g['count']}" if g["count"] > 1 else ""
                lines.append(f"  {n:>2}. {human_time(g['time']):>10} {100 * g['time'] / total:5.1f}%  "
                             f"{g['primitive']}{count}{_shape(g)} ({g['phase']}) in {g['scope'] or '(top)'}")
                m = _OP_ID.search(g["op"])
                lines.append(f"      at {g['source'] or '?'}" + (f"; e.g. {m.group(0)}" if m else ""))
                parts = [f"compute {human_time(g['compute'])}"]
                if g["collectives"]:
                    parts.append(f"own collectives {human_time(g['collectives'])}")
                if g["resharding"]:
                    parts.append(f"resharding into it {human_time(g['resharding'])}")
                lines.append(f"      {', '.join(parts)}; layout {g['layout']}")
        lines += ["", self.solver]
        return "\n".join(lines)


def _shape(group: dict[str, Any]) -> str:
    """`` [8, 32, 16384, 16384]``: a group's result shape (plans saved before it was recorded have none)."""
    shape = group.get("shape")
    return f" {list(shape)}" if shape else ""


def explain_plan(plan: Plan, *, top: int = 10) -> Explanation:
    """Read ``plan`` for a person (see the module docstring); ``.text()`` renders it."""
    time = tuple(sorted(((k, v) for k, v in plan.time_breakdown.items() if k != "resharding"),
                        key=lambda kv: -kv[1]))
    s = plan.solver
    solver = (f"solver: {s.status}{'' if s.optimal else ' (not proven optimal)'}, {s.nodes} nodes, {s.edges} edges"
              + (f", {s.fixed_inputs} inputs fixed by hand" if s.fixed_inputs else ""))
    return Explanation(
        mesh=str(plan.mesh), hardware=plan.hardware, step_time=plan.predicted_step_time, time=time,
        resharding=float(plan.time_breakdown.get("resharding", 0.0)), peak_memory=plan.peak_memory,
        memory_budget=plan.memory_budget, memory=tuple(memory_breakdown(plan).items()),
        classes=tuple(class_layouts(plan)), layers=tuple(layer_layouts(plan)),
        top_ops=tuple(s.top_ops[:top]), solver=solver, rewrites=tuple(rewrite_lines(plan)),
    )


# ---- why this layout? ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """One strategy of the node that produces the tensor asked about, priced with its neighbours fixed."""

    index: int
    spec: str  # the tensor's layout under this strategy
    reads: str  # the layouts it needs its operands in ("" for an input)
    compute: float
    collectives: float
    resharding: float  # on every edge the node touches, neighbours at the plan's choice
    memory: float  # bytes per device of the node's own tensors
    peak: float  # the step's peak memory per device with this strategy instead
    fits: bool
    chosen: bool
    objective: float  # what the solver weighs: time + resharding + the memory tie-break
    step_time: float | None = None  # with resolve=True: the best step time with this strategy forced

    @property
    def time(self) -> float:
        return self.compute + self.collectives + self.resharding


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TensorWhy:
    tensor: str
    shape: tuple[int, ...]
    node: str
    alternatives: tuple[Alternative, ...]  # cheapest first (by the solver's objective)
    neighbours: tuple[tuple[str, str, float], ...]  # (node, tensor, resharding under the plan)
    notes: tuple[str, ...] = ()

    @property
    def chosen(self) -> Alternative:
        return next(a for a in self.alternatives if a.chosen)

    @property
    def cheapest(self) -> Alternative:
        return self.alternatives[0]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def text(self, *, max_rows: int = 20) -> str:
        c = self.chosen
        lines = [f"why is {self.tensor} {list(self.shape)} laid out {c.spec}?",
                 f"  it is produced by {self.node}; {len(self.alternatives)} strategies, each priced with the "
                 "rest of the plan held fixed (cheapest first):",
                 f"  {'':2}{'layout':<26}{'time':>11}{'compute':>11}{'collect.':>11}{'reshard':>11}"
                 f"{'memory':>11}{'step peak':>11}  fits" + ("  re-solved step" if any(
                     a.step_time is not None for a in self.alternatives) else "")]
        for a in self.alternatives[:max_rows]:
            mark = "->" if a.chosen else "  "
            row = (f"  {mark}{a.spec:<26}{human_time(a.time):>11}{human_time(a.compute):>11}{human_time(a.collectives):>11}"
                   f"{human_time(a.resharding):>11}{human_bytes(a.memory):>11}{human_bytes(a.peak):>11}  "
                   f"{'yes' if a.fits else 'NO'}")
            if a.step_time is not None:
                row += f"  {human_time(a.step_time) if math.isfinite(a.step_time) else 'infeasible'}"
            lines.append(row)
            if a.reads:
                lines.append(f"      reads {a.reads}")
        if len(self.alternatives) > max_rows:
            lines.append(f"  ... {len(self.alternatives) - max_rows} more")
        best = self.cheapest
        if best.chosen:
            lines.append("  the chosen strategy is the cheapest one given its neighbours.")
            if not any(a.step_time is not None for a in self.alternatives) and any(
                    a.resharding > a.compute + a.collectives for a in self.alternatives):
                # GPT-1.3B, seq 16384, batch 8: the scores split along the query sequence read 80.45 ms here
                # (68 ms of it resharding batch-split neighbours), against 12.24 ms; re-solved, 1.2% slower
                lines.append("  (an alternative's resharding is to and from its neighbours' present layouts; "
                             "--resolve re-solves the step with each alternative forced, neighbours free)")
        else:
            lines.append(f"  {best.spec} would be {human_time(c.time - best.time)} cheaper here alone; the plan "
                         "keeps its choice because " + ("it does not fit otherwise." if not best.fits else
                                                         "the solver's answer is not proven optimal."))
        if self.neighbours:
            lines.append("  its edges under the plan (neighbour, tensor, resharding):")
            for name, tensor, t in self.neighbours[:max_rows]:
                lines.append(f"      {human_time(t):>10}  {tensor}  with {name}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def cost_model_of(plan: Plan) -> CostModel:
    """The cost model a plan was made with: its hardware preset or profile, on its exact mesh."""
    if not plan.hardware:
        raise PlanError("this plan does not name its hardware: pass the CostModel it was planned with")
    cost = cost_model_for(plan.hardware, plan.mesh.shape, plan.mesh.axis_names)
    return cost if cost.mesh == plan.mesh else dataclasses.replace(cost, mesh=plan.mesh)


def plan_choice(graph: Graph, built: BuiltProblem, plan: Plan) -> np.ndarray:
    """The plan's strategy per node of ``built``: the recorded choice when it fits this problem, else the
    plan's layouts matched onto each node's strategies."""
    k = built.problem.num_strategies
    if plan.solver.choice:
        choice = decode_choice(plan.solver.choice)
        if len(choice) == len(k) and bool(np.all(choice < k)) and _agrees(graph, built, plan, choice):
            return choice
    return _match_specs(graph, built, plan)


def _skip_keys(graph: Graph) -> set[TensorKey]:
    # returned train state is recorded in its input's layout, not the one its producer gave it
    return {((), graph.outputs[o]) for o in graph.output_aliases}


def _agrees(graph: Graph, built: BuiltProblem, plan: Plan, choice: np.ndarray) -> bool:
    skip = _skip_keys(graph)
    for i, node in enumerate(built.nodes):
        for key, spec in node.produces[int(choice[i])]:
            want = plan.specs.get(key[0], {}).get(key[1])
            if key not in skip and want is not None and want != spec:
                return False
    return True


def _match_specs(graph: Graph, built: BuiltProblem, plan: Plan, time_budget_s: float = 10.0) -> np.ndarray:
    """Strategies whose produced layouts are the plan's; where several are (same outputs, other operand
    layouts), the cheapest consistent assignment, found by the solver with every other strategy at +inf."""
    skip = _skip_keys(graph)
    out = np.zeros(len(built.nodes), dtype=np.int64)
    costs = list(built.problem.node_costs)
    for i, node in enumerate(built.nodes):
        fits = []
        for s in range(node.k):
            ok = True
            for key, spec in node.produces[s]:
                want = plan.specs.get(key[0], {}).get(key[1])
                if key not in skip and want is not None and want != spec:
                    ok = False
                    break
            if ok:
                fits.append(s)
        if not fits:
            raise PlanError(f"the plan's layouts match no strategy of {node.name}: it was made for another "
                            "trace of the step or another cost model")
        out[i] = min(fits, key=lambda s: float(node.cost[s]))
        if len(fits) < node.k:
            masked = np.full(node.k, math.inf)
            masked[fits] = costs[i][fits]
            costs[i] = masked
    problem = dataclasses.replace(built.problem, node_costs=costs, memory_limit=None)
    try:
        return solve_intra_op(problem, time_budget_s=time_budget_s, initial=out).choice
    except InfeasibleError:
        return out


def _find_tensor(built: BuiltProblem, graph: Graph, name: str) -> tuple[TensorKey, tuple[int, ...]]:
    if name in graph.output_names:
        tid = graph.outputs[graph.output_names.index(name)]
        return ((), tid), graph.tensors[tid].shape
    for scope, g in built.graphs.items():
        for t in g.tensors:
            if t.name == name:
                return (scope, t.id), t.shape
    raise PlanError(f"no tensor named {name!r} in the step; name an input (state.params...), an output "
                    "(out[0]...) or an intermediate (t123, as in the graph summary)")


def explain_tensor(
    graph: Graph,
    plan: Plan,
    cost: CostModel | None,
    name: str,
    *,
    resolve: bool = False,
    time_budget_s: float = 10.0,
    problems: ProblemCache | None = None,
) -> TensorWhy:
    """Why ``name`` got its layout: every strategy of the node producing it, priced with the rest of the
    plan fixed (see the module docstring). ``resolve=True`` also re-solves the whole problem once per
    alternative with that alternative forced (``time_budget_s`` shared among them)."""
    cost = cost if cost is not None else cost_model_of(plan)
    problems = problems if problems is not None else ProblemCache(graph)
    built = problems.get(cost, plan.memory_budget)
    choice = plan_choice(graph, built, plan)
    key, shape = _find_tensor(built, graph, name)
    u = next((i for i, node in enumerate(built.nodes) if any(k == key for k, _ in node.produces[0])), None)
    if u is None:
        raise PlanError(f"{name} is not placed by the solver (a constant or a tensor nothing reads)")
    node = built.nodes[u]
    p = built.problem
    incident = [(e, int(a), int(b)) for e, (a, b) in enumerate(p.edges.tolist()) if u in (a, b)]
    hold = MEMORY_TIE_BREAK / cost.memory_bandwidth
    budget = plan.memory_budget
    notes = []
    # priced as the plan was: its breakdown (collectives as issued), not the solver's sum (``step_time_of``)
    total = step_time_of_breakdown(breakdown(built, choice, cost))
    if not math.isclose(total, plan.predicted_step_time, rel_tol=1e-6, abs_tol=1e-12):
        notes.append(f"the rebuilt problem prices this plan at {human_time(total)}, the plan says "
                     f"{human_time(plan.predicted_step_time)}: the graph or cost model differ from the ones it was "
                     "planned with")
    forced_times = _resolve(built, u, time_budget_s) if resolve else {}
    alts = []
    for s in range(node.k):
        reshard = 0.0
        for e, a, b in incident:
            mat = p.edge_costs[e]
            reshard += float(mat[s, choice[b]] if a == u else mat[choice[a], s])
        trial = choice.copy()
        trial[u] = s
        peak = peak_memory_of(built, trial)
        reads = ", ".join(f"{spec}" if spec is not None else "(none works)" for _, spec in node.reads[s])
        alts.append(Alternative(
            index=s, spec=str(node.produced(key, s)), reads=reads if node.kind == "op" else "",
            compute=float(node.compute[s]), collectives=float(node.comm[s]),
            resharding=reshard, memory=float(node.memory[s]), peak=peak,
            fits=budget is None or peak <= budget * (1 + 1e-9), chosen=s == int(choice[u]),
            objective=float(node.cost[s]) + hold * float(node.memory[s]) + reshard,
            step_time=forced_times.get(s) if resolve else None,
        ))
    alts.sort(key=lambda a: (not a.fits, a.objective, not a.chosen))
    neighbours = []
    for e, a, b in incident:
        other = b if a == u else a
        info = built.edges[e]
        tname = built.graphs[info.tensor[0]].tensors[info.tensor[1]].name
        neighbours.append((built.nodes[other].name, tname, float(p.edge_costs[e][choice[a], choice[b]])))
    neighbours.sort(key=lambda x: -x[2])
    return TensorWhy(tensor=name, shape=tuple(shape), node=node.name, alternatives=tuple(alts),
                     neighbours=tuple(neighbours), notes=tuple(notes))


def _resolve(built: BuiltProblem, u: int, time_budget_s: float) -> dict[int, float]:
    """Per strategy of node ``u``: the best step time with ``u`` forced to it (inf when nothing fits)."""
    p = built.problem
    k = built.nodes[u].k
    out = {}
    for s in range(k):
        costs = list(p.node_costs)
        forced = np.full(k, math.inf)
        forced[s] = costs[u][s]
        costs[u] = forced
        try:
            sol = solve_intra_op(dataclasses.replace(p, node_costs=costs), time_budget_s=time_budget_s / k)
        except InfeasibleError:
            out[s] = math.inf
            continue
        out[s] = step_time_of(built, sol.choice)
    return out
