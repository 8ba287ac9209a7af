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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from autoshard._version import __version__
from autoshard.errors import AutoshardError
from autoshard.planner.utilization import ModelFlops
from autoshard.trace.graph import Graph, Scope
from autoshard.trace.unroll import layer_stacks
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

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole (``planner.beside`` sends it between processes)
        return type(self), (str(self), self.needed, self.as_traced)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SolverReport:
    """How a plan was found. Times in seconds (building the problem, the seed portfolio, the final solve); ``objective`` is what the solver minimised (the step time
    plus the memory tie-break), ``lower_bound`` a proven bound on it when the solver has one.

    ``seeds``: the objective of every automatic starting point (``planner.seeds``); ``starts``: of the
    user's; ``choice``: the strategy index per solver node (``encode_choice``); ``top_ops``: the costliest
    op groups (``readback.top_ops``); ``fixed_inputs``: how many inputs a hand layout pinned;
    ``trace_seconds``: tracing the step, when the planner traced it; ``pipeline_step_time``: the best
    pipelined plan's time, when one was planned and lost to this plan; ``cut_short``: what the time budget
    cut short, when it ran out (``planner.deadline.Deadline.note``)."""

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
    cut_short: str | None = None  # what a spent time budget cut short (``planner.deadline``), for the summary

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
    """The layout of one input or output leaf of the step. ``group``: its class where the name alone does not
    give it (a leaf of a block whose name carries no number, ``blocks.first.attn.kernel`` ->
    ``blocks.*.attn.kernel``: ``summary.input_class``, recorded by ``autoshard.plan``); empty otherwise."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    spec: ShardingSpec
    group: str = ""


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
    # the step's layer stacks written as one scan were unrolled before planning (``trace.unroll``,
    # ``PlanOptions.unroll_scans``): the plan's tensors are the unrolled step's (``recompute.as_planned``)
    unrolled: bool = False
    # bytes per device of the activations kept from the forward into the backward pass, counted once (the
    # peak counts them as many times as the plan's activation weight); None: not recorded (not saved)
    held_memory: float | None = None

    @property
    def mfu(self) -> float | None:
        """Predicted model FLOP utilization (``planner.utilization``), or None when not recorded."""
        return None if self.model_flops is None else self.model_flops.mfu(self.predicted_step_time,
                                                                          self.mesh.num_devices)

    # ---- checks ------------------------------------------------------------------------------------

    def verify(self, graph: Graph | None = None) -> None:
        """Every spec names mesh axes, fits its tensor's rank and splits only divisible dimensions; with a
        graph, the plan's inputs are the graph's (names, then shapes and dtypes: ``check_inputs``) and its
        layouts fit the graph's tensors."""
        for t in (*self.inputs, *self.outputs):
            try:
                t.spec.validate(t.shape, self.mesh, require_divisible=True)
            except ValueError as e:
                raise PlanError(f"plan layout of {t.name} {list(t.shape)}: {e}") from None
        if not math.isfinite(self.predicted_step_time) or self.predicted_step_time < 0:
            raise PlanError(f"predicted step time {self.predicted_step_time} is not a finite, non-negative time")
        check_axes(self.specs, self.mesh)
        if graph is None:
            return
        if self.unrolled and layer_stacks(graph):
            raise PlanError("the plan was made for the step with its layer stack (a scan) unrolled into layers, "
                            "and this graph keeps the scan: rewrite the trace as the plan was planned "
                            "(autoshard.planner.recompute.as_planned), or plan again with unroll_scans=False")
        names = [graph.tensors[i].name for i in graph.inputs]
        if names != [t.name for t in self.inputs]:
            raise PlanError("the plan's inputs are not this graph's inputs: plan another step, or retrace")
        check_inputs([(t.name, t.shape, t.dtype) for t in self.inputs], graph)
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

    # ---- the same plan on renamed axes ---------------------------------------------------------------

    def with_axis_names(self, names: Sequence[str]) -> Plan:
        """This plan with its mesh axes renamed by position (``names[i]`` for the plan's axis ``i``): every
        layout, the mesh, and the collectives' keys in ``time_breakdown`` and ``collective_counts``
        (``all_reduce(x)`` -> ``all_reduce(data)``). The layouts and the costs are unchanged; the plan runs
        on a device mesh of the same shape that names its axes ``names``."""
        names = tuple(str(n) for n in names)
        if len(names) != len(self.mesh.axis_names) or len(set(names)) != len(names):
            raise PlanError(f"cannot rename the plan's mesh axes {self.mesh.axis_names} to {names}: give one "
                            "distinct name per axis")
        to = dict(zip(self.mesh.axis_names, names, strict=True))
        if all(a == b for a, b in to.items()):
            return self

        def spec(s: ShardingSpec) -> ShardingSpec:
            return ShardingSpec(dims=tuple(tuple(to[a] for a in d) for d in s.dims),
                                partial=frozenset(to[a] for a in s.partial))

        def key(k: str) -> str:  # "all_reduce(x,y)" -> "all_reduce(data,model)"; "compute" stays
            kind, paren, axes = k.partition("(")
            parts = axes.rstrip(")").split(",")
            if not paren or not k.endswith(")") or not all(a in to for a in parts):
                return k
            return f"{kind}({','.join(to[a] for a in parts)})"

        def layout(t: TensorLayout) -> TensorLayout:
            return dataclasses.replace(t, spec=spec(t.spec))

        return dataclasses.replace(
            self, mesh=dataclasses.replace(self.mesh, axis_names=names),
            inputs=tuple(layout(t) for t in self.inputs), outputs=tuple(layout(t) for t in self.outputs),
            specs={scope: {tid: spec(s) for tid, s in table.items()} for scope, table in self.specs.items()},
            time_breakdown={key(k): v for k, v in self.time_breakdown.items()},
            collective_counts={key(k): v for k, v in self.collective_counts.items()})

    # ---- JSON --------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def layout(t: TensorLayout) -> dict[str, Any]:
            return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "role": t.role,
                    "spec": str(t.spec), **({"group": t.group} if t.group else {})}

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
            **({"unrolled": True} if self.unrolled else {}),
            **({} if self.model_flops is None else {"model_flops": self.model_flops.to_dict()}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        if d.get("version") != PLAN_VERSION:
            raise PlanError(f"plan format version {d.get('version')!r}; this autoshard reads version {PLAN_VERSION}")

        def layout(x: Mapping[str, Any]) -> TensorLayout:
            return TensorLayout(name=x["name"], shape=tuple(x["shape"]), dtype=x["dtype"], role=x["role"],
                                spec=ShardingSpec.parse(x["spec"]), group=x.get("group", ""))

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
            unrolled=bool(d.get("unrolled", False)),
            model_flops=ModelFlops.from_dict(d["model_flops"]) if "model_flops" in d else None,
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan saved at ``path``, checked (``verify``): a file edited by hand that no longer holds
        together (a mesh axis renamed in the mesh but not in the layouts) is refused here, naming what."""
        try:
            plan = cls.from_dict(json.loads(Path(path).read_text()))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, PlanError):
                raise PlanError(f"{path}: {e}") from None
            raise PlanError(f"{path} is not an autoshard plan ({type(e).__name__}: {e})") from None
        try:
            plan.verify()
        except PlanError as e:
            raise PlanError(f"{path} does not hold together: {e}. Was it edited? Plan again (autoshard plan ... "
                            "-o FILE), or rename mesh axes with Plan.with_axis_names, which renames them in every "
                            "layout too.") from None
        return plan


# one input leaf of a planned step: (name, shape, dtype), as ``Plan.inputs`` and ``PipelinePlan.inputs`` record it
InputSignature = tuple[str, tuple[int, ...], str]


def input_signature(graph: Graph) -> tuple[InputSignature, ...]:
    """The name, shape and dtype of each input leaf of ``graph``, in order."""
    return tuple((t.name, tuple(t.shape), t.dtype) for t in (graph.tensors[i] for i in graph.inputs))


def check_inputs(planned: Sequence[InputSignature], graph: Graph, *, note: str = "", limit: int = 3) -> None:
    """Refuse a plan whose input leaves differ in shape or dtype from ``graph``'s (a plan saved for one size
    of a model and run on another with the same parameter names), naming the first ``limit`` that differ.
    ``note`` is added after the list (what size a pipelined plan's trace is)."""
    given = {t.name: t for t in (graph.tensors[i] for i in graph.inputs)}
    differ = [(name, shape, dtype, given[name]) for name, shape, dtype in planned
              if name in given and (tuple(shape) != tuple(given[name].shape) or dtype != given[name].dtype)]
    if not differ:
        return
    lines = [f"  {name}: planned {dtype}{list(shape)}, given {t.dtype}{list(t.shape)}"
             for name, shape, dtype, t in differ[:limit]]
    if len(differ) > limit:
        lines.append(f"  ... and {len(differ) - limit} more")
    raise PlanError(
        f"the plan was made for a step with other input shapes or dtypes: {len(differ)} of its {len(planned)} "
        "input leaves differ (same names, another model size or batch?):\n" + "\n".join(lines) + note
        + "\nPlan again for this step (autoshard.parallelize without plan=, autoshard.plan, or `autoshard "
        "plan`) and save that plan; a plan's layouts and times hold only for the shapes it was made for.")


def check_axes(specs: Mapping[Scope, Mapping[int, ShardingSpec]], mesh: LogicalMesh, where: str = "") -> None:
    """Every layout of ``specs`` names only axes of ``mesh`` (a plan file's mesh renamed by hand leaves its
    layouts on the old names)."""
    names = set(mesh.axis_names)
    for scope, table in specs.items():
        for tid, spec in table.items():
            unknown = sorted(spec.axes_used - names)
            if unknown:
                raise PlanError(f"{where}the layout {spec} of tensor {tid}{f' in scope {list(scope)}' if scope else ''} "
                                f"uses mesh axis {unknown[0]!r}, which is not in the plan's mesh {mesh} "
                                f"(axes {', '.join(mesh.axis_names)})")


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


