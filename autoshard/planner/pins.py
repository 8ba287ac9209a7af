"""Hand-written layouts held fixed: input names checked against the step and the mesh, and the solver
problem with those inputs' nodes pinned (every other strategy of theirs costs +inf)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from autoshard.planner.build import BuiltProblem
from autoshard.planner.plan import PlanError
from autoshard.trace.graph import Graph
from cost_models import LogicalMesh, ShardingSpec
from solvers import IntraOpProblem


def input_nodes(built: BuiltProblem) -> dict[int, int]:
    """Top-level input tensor id -> the node whose strategies are its layouts."""
    return {node.produces[0][0][0][1]: i for i, node in enumerate(built.nodes) if node.kind == "input"}


def pin(graph: Graph, built: BuiltProblem, fixed: Mapping[int, ShardingSpec] | None, *,
        strict: bool = True) -> IntraOpProblem | None:
    """``built.problem`` with each input in ``fixed`` (tensor id -> layout) held at its layout: every other
    strategy of its node costs +inf. A layout the node does not have raises PlanError (``strict``) or
    gives None."""
    if not fixed:
        return built.problem
    costs = list(built.problem.node_costs)
    nodes = input_nodes(built)
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
            mesh = mesh or _mesh_of(specs)
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


def _mesh_of(specs: list[ShardingSpec]) -> str:
    axes = sorted({a for sp in specs for a in sp.sharded_axes})
    return f" (mesh axes {', '.join(axes)})" if axes else ""


def fixed_ids(graph: Graph, fixed: Mapping[str, ShardingSpec] | None, mesh: LogicalMesh) -> dict[int, ShardingSpec]:
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
