"""A solution read back: the layouts per tensor, the step time by category, memory, where the time goes.

Everything here is a function of a built problem (``planner.build.BuiltProblem``) and one strategy index
per node (``choice``); the objective sums and memory sweeps are the solver problem's own
(``IntraOpProblem.cost_of``, ``IntraOpProblem.memory_usage``), so that a plan reports what was solved.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from autoshard.planner.build import BuiltProblem
from autoshard.planner.plan import TensorLayout
from autoshard.planner.summary import fold_layer_indices
from autoshard.trace.graph import Graph, Scope
from cost_models import CostModel, ShardingSpec

TOP_OPS = 30  # op groups recorded per plan, costliest first


def layouts(graph: Graph, built: BuiltProblem, choice: np.ndarray, pins: Mapping[int, ShardingSpec]
            ) -> tuple[dict[Scope, dict[int, ShardingSpec]], tuple[TensorLayout, ...], tuple[TensorLayout, ...]]:
    """(layouts per scope and tensor id, the step's input layouts, its output layouts) under ``choice``.

    Inputs and outputs are materialised (no pending sums); returned train state goes back in the layout
    it came in (the tie edge's price is in the objective), and is recorded so in the scope table too.
    An input no node reads keeps its pinned layout, else it is replicated."""
    specs: dict[Scope, dict[int, ShardingSpec]] = defaultdict(dict)
    for i, node in enumerate(built.nodes):
        for (scope, tid), spec in node.produces[int(choice[i])]:
            specs[scope][tid] = spec
    top = specs.get((), {})

    def layout(tid: int, name: str) -> TensorLayout:
        t = graph.tensors[tid]
        spec = top.get(tid, pins.get(tid, ShardingSpec.replicated(len(t.shape))))
        return TensorLayout(name=name, shape=t.shape, dtype=t.dtype, role=t.role.value,
                            spec=ShardingSpec(dims=spec.dims))

    inputs = tuple(layout(tid, graph.tensors[tid].name) for tid in graph.inputs)
    outputs = []
    for o, tid in enumerate(graph.outputs):
        i = graph.output_aliases.get(o)
        lay = layout(tid, graph.output_names[o])
        if i is not None:
            lay = dataclasses.replace(lay, spec=inputs[i].spec)
            specs[()][tid] = inputs[i].spec
        outputs.append(lay)
    return {k: dict(v) for k, v in specs.items()}, inputs, tuple(outputs)


def issued(built: BuiltProblem, choice: np.ndarray, cost: CostModel) -> Iterator[tuple[str, float, float, bool]]:
    """Every collective the plan issues, as ``(key, seconds, times, on_edge)``: ``key`` its kind and mesh
    axes (``all_gather(x)``), ``seconds`` one issue's time, ``times`` how often a step issues it (the node's or
    edge's weight: a loop body's collective once per iteration), ``on_edge`` whether it reshards between two
    ops. Three sources: an op's own strategy (the all-reduce of a matmul's partial sums), each resharding
    edge (an all-gather of a sharded weight for a replicated matmul: once per reading op, so a weight read by
    a forward and a backward matmul is gathered twice, as FSDP does), and the pending sums the step returns
    (a gradient reduced as the step ends). An all-reduce of a gradient is one of ``built.combine`` that XLA
    issues as one instruction: it is counted as a value, as the compiled program's tuple has one, at its share
    of the time (``planner.build``, "Gradients reduced together")."""
    for i, node in enumerate(built.nodes):
        st = node.strategies[int(choice[i])]
        if st is not None:
            scope, op_id = node.ops[0]
            outs = built.graphs[scope].ops[op_id].outputs
            k = min((built.combine_of((scope, t)) for t in outs), default=1)
            for c in st.comm:
                yield f"{c.kind}({','.join(c.axes)})", cost.step_time(c.kind, c.nbytes, c.axes, k), node.weight, False
    p = built.problem
    for (u, v), mat, e in zip(p.edges, p.edge_costs, built.edges, strict=True):
        if float(mat[choice[u], choice[v]]) <= 0:
            continue
        tensor = built.graphs[e.tensor[0]].tensors[e.tensor[1]]
        src = built.nodes[u].produced(e.tensor, int(choice[u]))
        s_v = int(choice[v])
        dst = built.nodes[v].needed(e.target, s_v) if e.kind == "data" else built.nodes[v].produced(e.target, s_v)
        if src is not None and dst is not None:
            k = built.combine_of(e.tensor) if e.kind == "data" else 1
            for step in cost.reshard(tensor.shape, tensor.dtype, src, dst, combine=k).steps:
                yield f"{step.kind}({','.join(step.axes)})", step.time, e.weight, True
    g = built.graphs[()]
    results = {((), t) for t in g.outputs}
    for i, node in enumerate(built.nodes):  # pending sums reduced as the step returns them
        for key, spec in node.produces[int(choice[i])]:
            if key in results and spec.partial:
                results.discard(key)
                t = g.tensors[key[1]]
                for step in cost.reshard(t.shape, t.dtype, spec, ShardingSpec(dims=spec.dims),
                                         combine=built.combine_of(key)).steps:
                    yield f"{step.kind}({','.join(step.axes)})", step.time, 1.0, False


def breakdown(built: BuiltProblem, choice: np.ndarray, cost: CostModel) -> dict[str, float]:
    """Seconds by category: ``compute``, one entry per collective kind and mesh axes (``all_reduce(x)``:
    the ops' own collectives, resharding on edges and the reduction of pending sums the step returns;
    ``issued``), and ``resharding``, the edges' whole price (not to be added again)."""
    out: dict[str, float] = defaultdict(float)
    for i, node in enumerate(built.nodes):
        out["compute"] += float(node.compute[int(choice[i])])
    p = built.problem
    for (u, v), mat in zip(p.edges, p.edge_costs, strict=True):
        t = float(mat[choice[u], choice[v]])
        if t > 0:
            out["resharding"] += t
    for key, seconds, times, _ in issued(built, choice, cost):
        out[key] += seconds * times
    return dict(out)


def step_time_of_breakdown(by_category: Mapping[str, float]) -> float:
    """A plan's predicted step time from its ``breakdown``: every category but ``resharding`` (already
    inside the collectives'). It prices the collectives as issued (a gradient's all-reduce at its share of
    the combined one), so it differs from ``step_time_of``, the solver's sum of node and edge costs."""
    return math.fsum(v for k, v in by_category.items() if k != "resharding")


def collective_counts(built: BuiltProblem, choice: np.ndarray, cost: CostModel) -> dict[str, int]:
    """How many collectives of each kind and mesh axes one step issues (``issued``, before XLA combines
    small ones into one tuple collective)."""
    out: dict[str, float] = defaultdict(float)
    for key, _, times, _ in issued(built, choice, cost):
        out[key] += times
    return {k: round(v) for k, v in sorted(out.items())}


def peak_memory_of(built: BuiltProblem, choice: Sequence[int] | np.ndarray) -> float:
    """Peak over the schedule of the summed bytes per device of the live nodes under ``choice``."""
    _, usage = built.problem.memory_usage(choice)
    return float(usage.max()) if usage.size else 0.0


def held_memory_of(built: BuiltProblem, choice: Sequence[int] | np.ndarray) -> float:
    """Bytes per device of the activations kept from the forward into the backward pass under ``choice``,
    counted once (what ``activation_weight`` multiplies in the peak)."""
    return float(sum(built.nodes[i].memory[int(choice[i])] for i in built.stashed))


def memory_at_peak(built: BuiltProblem, choice: Sequence[int] | np.ndarray, top: int = 3
                   ) -> tuple[float, int, list[tuple[str, float]]]:
    """(peak bytes, time step of the peak, the ``top`` largest nodes live there with their bytes)."""
    p = built.problem
    points, usage = p.memory_usage(choice)
    if not usage.size:
        return 0.0, 0, []
    k = int(np.argmax(usage))
    at = int(points[k])
    live = [(i, float(p.node_memory[i][choice[i]])) for i in range(len(built.nodes))
            if built.nodes[i].interval[0] <= at < built.nodes[i].interval[1]]
    live.sort(key=lambda x: -x[1])
    return float(usage[k]), at, [(node_label(built, i, int(choice[i])), b) for i, b in live[:top]]


def node_label(built: BuiltProblem, i: int, s: int) -> str:
    """An input node by its tensor's name; an op node by the tensor it makes, its layout and the op."""
    node = built.nodes[i]
    if node.kind == "input":
        return f"{node.name} ({node.produces[s][0][1]})"
    (scope, tid), spec = node.produces[s][-1]
    t = built.graphs[scope].tensors[tid]
    return f"{t.name} {list(t.shape)} {spec} from {node.name}"


def step_time_of(built: BuiltProblem, choice: Sequence[int] | np.ndarray) -> float:
    """The step time under ``choice``: node costs without the memory tie-break, plus resharding."""
    p = built.problem
    return float(sum(float(n.cost[c]) for n, c in zip(built.nodes, np.asarray(choice).tolist(), strict=True))
                 + sum(float(m[choice[a], choice[b]]) for (a, b), m in zip(p.edges.tolist(), p.edge_costs,
                                                                          strict=True)))


def top_ops(built: BuiltProblem, choice: np.ndarray, n: int = TOP_OPS) -> list[dict[str, Any]]:
    """The op groups where the step's time goes under ``choice``, costliest first, as JSON-ready dicts.

    A node's time is its own cost (compute and collectives, times its trip count) plus the resharding on
    the edges into it (on an edge into an input node, the tie of returned state: charged to its producer).
    Nodes are folded by (primitive, name scope with layer indices as ``_*``, source line, phase, result
    shape), so the 24 copies of one matmul in a 24-layer model are one entry with ``count`` 24. The shape
    keeps apart ops of one line that differ in size: the causal mask's [S, S] ``select_n`` and the scores'
    [B, heads, S, S] one, folded together, read as the mask costing what the scores do."""
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
        folded = fold_layer_indices(op.scope)
        shape = built.graphs[scope].tensors[op.outputs[0]].shape if op.outputs else ()
        key = (op.primitive, folded, op.source, op.phase, node.kind, shape)
        g = groups.get(key)
        if g is None:
            reads = ", ".join(str(spec) for _, spec in node.reads[s][:3])
            outs = ", ".join(str(spec) for _, spec in node.produces[s][:1])
            g = groups[key] = {
                "op": op.where(), "primitive": op.primitive, "scope": folded, "source": op.source,
                "phase": op.phase, "shape": list(shape), "layout": f"{reads} -> {outs}", "count": 0, "time": 0.0,
                "compute": 0.0,
                "collectives": 0.0, "resharding": 0.0,
            }
        g["count"] += 1
        g["time"] += t
        g["compute"] += float(node.compute[s])
        g["collectives"] += float(node.comm[s])
        g["resharding"] += float(res[i])
    return sorted(groups.values(), key=lambda g: -g["time"])[:n]
