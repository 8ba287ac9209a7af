"""The Plan: everything needed to run a sharded step, as plain data (JSON round-trip, ``verify()``).

A ``Plan`` holds the mesh, the layout of every input and output of the step and of every tensor the solver
placed (per scope: the top level and each control-flow body), the predicted step time split by category,
the predicted peak memory per device, and a ``SolverReport``: how the solve went, the solver's choice per
node (``choice``, to answer why-questions later) and the op groups that cost the most (``top_ops``).

Making one is ``autoshard.planner.planning.plan_graph``; reading one for a person is
``autoshard.planner.explain`` (``explain_plan``) and ``autoshard.planner.compare`` (``diff_plans``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from autoshard._version import __version__
from autoshard.errors import AutoshardError
from autoshard.planner.utilization import ModelFlops
from autoshard.trace.graph import Graph, Scope
from cost_models import LogicalMesh, ShardingSpec

PLAN_VERSION = 1
TOP_OPS = 30  # op groups recorded per plan, costliest first


class PlanError(AutoshardError, ValueError):
    """A plan that does not fit its graph or mesh, or a file that is not a plan."""


class DoesNotFit(PlanError):
    """No layout of the step fits the memory budget (proven by the solver): more devices, microbatches or
    recompute may. ``needed``: the least bytes per device the solver found the step needs (None: unknown);
    ``as_traced``: that need without recompute, when it was found."""

    def __init__(self, message: str, needed: float | None = None, as_traced: float | None = None) -> None:
        super().__init__(message)
        self.needed = needed
        self.as_traced = needed if as_traced is None else as_traced


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SolverReport:
    """How a plan was found. Times in seconds (building the problem, the seed portfolio, the final solve); ``objective`` is what the solver minimised (the step time
    plus the memory tie-break), ``lower_bound`` a proven bound on it when the solver has one.

    ``seeds``: the objective of every automatic starting point (``planner.seeds``); ``starts``: of the
    user's; ``choice``: the strategy index per solver node (``encode_choice``); ``top_ops``: the costliest
    op groups (``readback.top_ops``); ``fixed_inputs``: how many inputs a hand layout pinned;
    ``trace_seconds``: tracing the step, when the planner traced it; ``pipeline_step_time``: the best
    pipelined plan's time, when one was planned and lost to this plan."""

    status: str
    optimal: bool
    objective: float
    lower_bound: float | None
    build_seconds: float
    seed_seconds: float = 0.0
    solve_seconds: float
    nodes: int
    edges: int
    strategies: int
    choice: str
    top_ops: tuple[Mapping[str, Any], ...] = ()
    seeds: Mapping[str, float] = dataclasses.field(default_factory=dict)
    starts: Mapping[str, float] | None = None
    fixed_inputs: int | None = None
    trace_seconds: float | None = None
    pipeline_step_time: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["top_ops"], d["seeds"] = list(self.top_ops), dict(self.seeds)
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SolverReport:
        names = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in d.items() if k in names}
        known["top_ops"] = tuple(known.get("top_ops", ()))
        return cls(**known)


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
    solver: SolverReport
    versions: Mapping[str, str]
    # how many collectives of each "kind(axes)" of time_breakdown one step issues, before XLA combines
    # small ones (``readback.collective_counts``); empty in plans saved before it was recorded
    collective_counts: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # block (layer tag) -> recompute mode, for the blocks the planned graph recomputes
    # (``trace.remat``): the step is emitted with that rewrite applied; empty: as traced
    recompute: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # 3x the step's forward matmul flops and their peak (``planner.utilization``); None: not recorded
    model_flops: ModelFlops | None = None

    @property
    def mfu(self) -> float | None:
        """Predicted model FLOP utilization (``planner.utilization``), or None when not recorded."""
        return None if self.model_flops is None else self.model_flops.mfu(self.predicted_step_time,
                                                                          self.mesh.num_devices)

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
            "specs": specs_to_json(self.specs),
            "time_breakdown": dict(self.time_breakdown),
            "predicted_step_time": self.predicted_step_time,
            "peak_memory": self.peak_memory,
            "solver": self.solver.to_dict(),
            "versions": dict(self.versions),
            "collective_counts": dict(self.collective_counts),
            "recompute": dict(self.recompute),
            **({} if self.model_flops is None else {"model_flops": self.model_flops.to_dict()}),
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
            specs=specs_from_json(d["specs"]),
            time_breakdown=dict(d["time_breakdown"]),
            predicted_step_time=float(d["predicted_step_time"]),
            peak_memory=float(d["peak_memory"]),
            solver=SolverReport.from_dict(d["solver"]),
            versions=dict(d["versions"]),
            collective_counts={k: int(v) for k, v in d.get("collective_counts", {}).items()},
            recompute=dict(d.get("recompute", {})),
            model_flops=ModelFlops.from_dict(d["model_flops"]) if "model_flops" in d else None,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise PlanError(f"{path} is not an autoshard plan ({type(e).__name__}: {e})") from None


def specs_to_json(specs: Mapping[Scope, Mapping[int, ShardingSpec]]) -> list[dict[str, Any]]:
    """Layouts per scope as JSON: ``[{"scope": [[op, body], ...], "tensors": {"id": "S(x)·R"}}, ...]``."""
    return [{"scope": [list(p) for p in scope], "tensors": {str(k): str(v) for k, v in sorted(table.items())}}
            for scope, table in specs.items()]


def specs_from_json(data: list[Any]) -> dict[Scope, dict[int, ShardingSpec]]:
    return {tuple(tuple(p) for p in e["scope"]): {int(k): ShardingSpec.parse(v) for k, v in e["tensors"].items()}
            for e in data}


def versions() -> dict[str, str]:
    """The versions a plan records."""
    import jax

    return {"autoshard": __version__, "jax": jax.__version__}


def encode_choice(choice: np.ndarray) -> str:
    """The solver's strategy index per node, as recorded in ``plan.solver.choice``."""
    return " ".join(str(int(c)) for c in choice)


def decode_choice(text: str) -> np.ndarray:
    return np.array([int(c) for c in text.split()], dtype=np.int64)


