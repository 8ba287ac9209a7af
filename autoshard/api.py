"""The public surface: ``autoshard.plan`` (pure planning on a logical mesh) and ``@autoshard.parallelize``
(trace, plan, emit and run on the devices present)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from autoshard.errors import AutoshardError
from autoshard.pipeline.planner import PipelinePlan
from autoshard.planner.plan import Plan, PlanError, plan_graph
from autoshard.trace import Graph, trace
from cost_models import CostModel, presets

log = logging.getLogger("autoshard")

DEFAULT_MEMORY_MARGIN = 0.10  # keep 10% of device memory free for XLA's temporaries and fragmentation
_DEFAULT_AXIS_NAMES = {1: ("x",), 2: ("x", "y"), 3: ("x", "y", "z")}
MeshLike = Sequence[int] | Mapping[str, int] | str


class PlanningError(AutoshardError, ValueError):
    """Bad planning arguments: a mesh that does not fit the devices, an unknown hardware name."""


def parse_mesh(mesh: MeshLike) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"8x8"``, ``(2, 4)`` or ``{"data": 2, "model": 4}`` -> (shape, axis names)."""
    if isinstance(mesh, str):
        try:
            shape = tuple(int(p) for p in mesh.lower().split("x"))
        except ValueError:
            raise PlanningError(f"mesh {mesh!r}: expected sizes joined by 'x', e.g. 8 or 2x4 or 8x8") from None
        return shape, _names_for(shape)
    if isinstance(mesh, Mapping):
        return tuple(int(v) for v in mesh.values()), tuple(str(k) for k in mesh)
    shape = tuple(int(s) for s in mesh)
    return shape, _names_for(shape)


def _names_for(shape: tuple[int, ...]) -> tuple[str, ...]:
    if any(s < 1 for s in shape) or not shape:
        raise PlanningError(f"mesh shape {shape}: every axis needs a size >= 1")
    return _DEFAULT_AXIS_NAMES.get(len(shape), tuple(f"a{i}" for i in range(len(shape))))


def cost_model_for(hardware: str | CostModel, shape: tuple[int, ...], names: tuple[str, ...]) -> CostModel:
    """A cost model of ``hardware`` (a preset name, a profile file, ``"auto"``, or a CostModel) on a mesh."""
    if isinstance(hardware, CostModel):
        if hardware.mesh.shape == shape and hardware.mesh.axis_names == names:
            return hardware  # keep its links, which may have been set by hand
        return hardware.with_mesh(shape, names)
    if hardware == "auto":
        hardware = _detect_hardware()
    try:
        if hardware in presets.names():
            # a preset describes a kind of machine, not a cluster size: a logical mesh larger than its
            # default cluster gets as many hosts as it needs (a measured profile stays what was measured)
            dph = presets.get(hardware).devices_per_host
            hosts = max(presets.get(hardware).num_hosts, -(-math.prod(shape) // dph))
            return CostModel.load(hardware, mesh_shape=shape, axis_names=names, num_hosts=hosts)
        return CostModel.load(hardware, mesh_shape=shape, axis_names=names)
    except ValueError as e:
        raise PlanningError(f"hardware {hardware!r}: {e}") from None


def _detect_hardware() -> str:
    kind = jax.devices()[0].device_kind.lower()
    for name in ("h200", "h100", "a100", "v100"):
        if name in kind:
            return name
    if jax.devices()[0].platform == "cpu":
        return "cpu-8dev-2026-11-21.json"
    log.warning("autoshard: no preset for device kind %r; planning with the h100 preset", kind)
    return "h100"


def _budget(memory_budget: float | str | None, cost: CostModel) -> float | None:
    if memory_budget is None:
        return None
    if memory_budget == "auto":
        return cost.memory_capacity * (1 - DEFAULT_MEMORY_MARGIN)
    if isinstance(memory_budget, str):
        raise PlanningError(f"memory_budget {memory_budget!r}: give bytes, 'auto' or None")
    return float(memory_budget)


def plan(
    step_fn: Callable[..., Any] | Graph,
    *args: Any,
    mesh: MeshLike = (8,),
    hardware: str | CostModel = "h100",
    memory_budget: float | str | None = "auto",
    time_budget_s: float = 60.0,
    roles: Mapping[str, str] | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    pipeline: bool | None = None,
    num_layers: int | None = None,
    max_stages: int | None = None,
    stage_shape: tuple[int, int] | None = None,
) -> Plan | PipelinePlan:
    """Plan ``step_fn(*args)`` on a logical mesh; no devices needed (args may be ShapeDtypeStructs).

    ``memory_budget``: bytes per device; ``"auto"`` (the default) is the hardware's capacity less 10%;
    ``None`` plans without a memory limit.

    Pipelines: with ``microbatches=B`` the step is also planned as a pipeline (stages on submeshes, ``B``
    microbatches, ``schedule`` "1f1b" or "gpipe", ``num_layers`` layers to cut, at most ``max_stages``
    stages, ``stage_shape=(hosts, devices)`` to fix every stage's submesh) and the plan with the lower
    predicted step time is returned (a ``PipelinePlan`` or a ``Plan``); ``pipeline=True`` always returns
    the pipeline, ``pipeline=False`` never plans one.
    """
    return _plan_traced(step_fn, args, mesh=mesh, hardware=hardware, memory_budget=memory_budget,
                        time_budget_s=time_budget_s, roles=roles, microbatches=microbatches, schedule=schedule,
                        pipeline=pipeline, num_layers=num_layers, max_stages=max_stages,
                        stage_shape=stage_shape)[0]


def _plan_traced(step_fn: Callable[..., Any] | Graph, args: tuple[Any, ...], *, mesh: MeshLike,
                 hardware: str | CostModel, memory_budget: float | str | None, time_budget_s: float,
                 roles: Mapping[str, str] | None, microbatches: int | None, schedule: str,
                 pipeline: bool | None, num_layers: int | None, max_stages: int | None,
                 stage_shape: tuple[int, int] | None) -> tuple[Plan | PipelinePlan, Graph, Graph | None]:
    """``plan``, also returning the traces it made: (plan, the step's graph, the microbatch-sized graph
    or None), so that ``parallelize`` emits from them instead of tracing again."""
    shape, names = parse_mesh(mesh)
    if hardware == "auto":
        hardware = _detect_hardware()
    cost = cost_model_for(hardware, shape, names)
    budget = _budget(memory_budget, cost)
    name = hardware if isinstance(hardware, str) else cost.cluster.device.name
    t0 = time.perf_counter()
    graph = step_fn if isinstance(step_fn, Graph) else trace(step_fn, *args, roles=roles)
    t_trace = time.perf_counter() - t0
    if pipeline and not microbatches:
        raise PlanningError("pipeline=True needs microbatches=B (the number of microbatches per step)")
    intra: Plan | None = None
    intra_error: Exception | None = None
    if not pipeline:
        try:
            intra = plan_graph(graph, cost, hardware=name, memory_budget=budget, time_budget_s=time_budget_s)
        except PlanError as e:
            if microbatches is None or pipeline is False:
                raise
            intra_error = e
        if intra is not None and not isinstance(step_fn, Graph):
            intra.solver["trace_seconds"] = t_trace
    if not microbatches or pipeline is False:
        assert intra is not None
        return intra, graph, None
    if isinstance(step_fn, Graph):
        raise PlanningError("a pipelined plan traces the step at microbatch size: pass the step function and "
                            "its arguments, not a Graph")
    from autoshard.pipeline.planner import microbatch_args, plan_pipeline

    micro = trace(step_fn, *microbatch_args(args, graph, None, microbatches), roles=roles)
    try:
        piped = plan_pipeline(micro, cost, hardware=name, memory_budget=budget, num_microbatches=microbatches,
                              schedule_name=schedule, num_layers=num_layers, time_budget_s=time_budget_s,
                              max_stages=max_stages, stage_shape=stage_shape)
    except AutoshardError as e:
        if intra is not None and pipeline is None:
            log.warning("autoshard: no pipelined plan (%s); using the intra-operator plan", e)
            return intra, graph, micro
        if intra_error is not None:
            raise PlanningError(f"neither plan fits.\nintra-operator: {intra_error}\npipeline: {e}") from None
        raise
    if intra is not None:
        piped.solver["intra_op_step_time"] = intra.predicted_step_time
    elif intra_error is not None:
        piped.solver["intra_op_step_time"] = f"no plan: {str(intra_error).splitlines()[0]}"
    if intra is not None and pipeline is None and intra.predicted_step_time <= piped.predicted_step_time:
        intra.solver["pipeline_step_time"] = piped.predicted_step_time
        return intra, graph, micro
    return piped, graph, micro


def _device_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    devices = jax.devices()
    n = int(np.prod(shape))
    if n > len(devices):
        raise PlanningError(
            f"mesh {'x'.join(map(str, shape))} needs {n} devices but {len(devices)} are present; plan for a "
            "larger cluster with autoshard.plan (no devices needed), or pick a smaller mesh"
        )
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names)


@dataclasses.dataclass(slots=True)
class _Compiled:
    graph: Graph  # for a pipelined plan: the trace at microbatch size
    plan: Plan | PipelinePlan
    step: Any


class parallelize:  # lower case: used as a decorator, like jax.jit
    """Decorate a train step: the first call traces, plans and compiles it for the mesh; later calls with
    the same argument shapes reuse the compiled program. ``.plan`` is the latest plan, ``.explain()``
    prints it.

        @autoshard.parallelize(mesh=(2, 4))
        def train_step(state, batch): ...
    """

    def __init__(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        mesh: MeshLike | None = None,
        hardware: str | CostModel = "auto",
        memory_budget: float | str | None = "auto",
        time_budget_s: float = 60.0,
        roles: Mapping[str, str] | None = None,
        microbatches: int | None = None,
        schedule: str = "1f1b",
        pipeline: bool | None = None,
        num_layers: int | None = None,
        stage_shape: tuple[int, int] | None = None,
    ) -> None:
        self.fn = fn
        self.num_layers = num_layers
        self.stage_shape = stage_shape
        self.microbatches = microbatches
        self.schedule = schedule
        self.pipeline = pipeline
        self.mesh = mesh if mesh is not None else (len(jax.devices()),)
        self.hardware = hardware
        self.memory_budget = memory_budget
        self.time_budget_s = time_budget_s
        self.roles = roles
        self._cache: dict[Any, _Compiled] = {}
        self._last: _Compiled | None = None

    def __call__(self, *args: Any) -> Any:
        if self.fn is None:  # used as @parallelize(...): the first call receives the function
            (fn,) = args
            self.fn = fn
            return self
        leaves, tree = jax.tree_util.tree_flatten(args)
        key = (tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x).__name__))) for x in leaves))
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compile(args)
            self._cache[key] = compiled
            place = getattr(compiled.step, "place_state", None)
            if place is not None:
                # laid out (and copied) as the program wants them: the next call, fed this call's
                # results, then hits the same compiled program instead of compiling a second one for
                # arguments that are already on the devices
                args = place(*args)
        self._last = compiled
        return compiled.step(*args)

    def _compile(self, args: tuple[Any, ...]) -> _Compiled:
        from autoshard.emit import emit

        shape, names = parse_mesh(self.mesh)
        device_mesh = _device_mesh(shape, names)
        the_plan, graph, micro = _plan_traced(
            self.fn, args, mesh=dict(zip(names, shape, strict=True)), hardware=self.hardware,
            memory_budget=self.memory_budget, time_budget_s=self.time_budget_s, roles=self.roles,
            microbatches=self.microbatches, schedule=self.schedule, pipeline=self.pipeline,
            num_layers=self.num_layers, max_stages=None, stage_shape=self.stage_shape)
        if isinstance(the_plan, Plan):  # tracing ran nothing: concrete args were fine
            return _Compiled(graph, the_plan, emit(graph, the_plan.specs, device_mesh))
        from autoshard.pipeline import build_pipelined_step

        assert micro is not None
        return _Compiled(micro, the_plan, build_pipelined_step(micro, the_plan, list(device_mesh.devices.flat)))

    @property
    def plan(self) -> Plan | PipelinePlan:
        if self._last is None:
            raise PlanningError("no plan yet: call the decorated step once (it plans on its first call)")
        return self._last.plan

    @property
    def graph(self) -> Graph:
        if self._last is None:
            raise PlanningError("no graph yet: call the decorated step once")
        return self._last.graph

    def explain(self) -> str:
        return self.plan.explain()
