"""What a plan is made for, as frozen data: ``Target`` (mesh, hardware, memory budget) and
``PipelineOptions`` (microbatches, schedule, stages).

Every entry point (``autoshard.plan``, ``@autoshard.parallelize``, the CLI's ``plan`` and ``compare``) builds
these once from its ``PlanOptions`` (``autoshard.options``), which holds what the user wrote (``"8x8"``,
``(2, 4)``, ``{"data": 2, "model": 4}``; a preset name, a profile file, ``"auto"`` or a ``CostModel``; bytes,
``"auto"`` or ``None``), and the passes below take them as they are. Nothing here depends on a pass: every
module below ``autoshard.api`` may use it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from autoshard.errors import AutoshardError
from cost_models import CostModel, presets

log = logging.getLogger("autoshard")

DEFAULT_MEMORY_MARGIN = 0.10  # keep 10% of device memory free for XLA's temporaries and fragmentation
DEFAULT_AXIS_NAMES = {1: ("x",), 2: ("x", "y"), 3: ("x", "y", "z")}
# the schedules the pipeline runtimes run (ZB-V, two chunks a stage in a V: the SPMD program only)
SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-v")
SPMD_ONLY = ("zb-v",)  # of those, the schedules only the SPMD program runs
MeshLike = Sequence[int] | Mapping[str, int] | str | Any  # Any: a jax.sharding.Mesh or AbstractMesh
HardwareLike = str | CostModel
BudgetLike = float | int | str | None


class PlanningError(AutoshardError, ValueError):
    """Bad planning arguments: a mesh that does not fit the devices, an unknown hardware name."""


def parse_mesh(mesh: MeshLike, axis_names: Sequence[str] | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"8x8"``, ``(2, 4)``, ``{"data": 2, "model": 4}`` or a ``jax.sharding.Mesh`` / ``AbstractMesh``
    -> (shape, axis names); ``axis_names`` names the axes of a shape given without names."""
    if hasattr(mesh, "axis_names") and hasattr(mesh, "axis_sizes"):  # a JAX mesh, concrete or abstract
        if axis_names is not None:
            raise PlanningError("axis names given twice: by the JAX mesh and by axis_names")
        shape, names = tuple(int(s) for s in mesh.axis_sizes), tuple(str(a) for a in mesh.axis_names)
        _check_shape(shape)
        return shape, _check_names(names)
    if isinstance(mesh, str):
        try:
            shape = tuple(int(p) for p in mesh.lower().split("x"))
        except ValueError:
            raise PlanningError(f"mesh {mesh!r}: expected sizes joined by 'x', e.g. 8 or 2x4 or 8x8") from None
    elif isinstance(mesh, Mapping):
        shape, names = tuple(int(v) for v in mesh.values()), tuple(str(k) for k in mesh)
        _check_shape(shape)
        if axis_names is not None:
            raise PlanningError("axis names given twice: by the mesh mapping and by axis_names")
        return shape, _check_names(names)
    elif isinstance(mesh, Sequence):
        try:
            shape = tuple(int(s) for s in mesh)
        except (TypeError, ValueError):
            raise PlanningError(f"mesh {mesh!r}: expected sizes such as (2, 4), '2x4', {{'data': 2, 'model': 4}} "
                                "or a jax.sharding.Mesh") from None
    else:
        raise PlanningError(f"mesh {mesh!r} ({type(mesh).__name__}): expected sizes such as (2, 4), '2x4', "
                            "{'data': 2, 'model': 4}, or a jax.sharding.Mesh / AbstractMesh")
    _check_shape(shape)
    if axis_names is None:
        return shape, DEFAULT_AXIS_NAMES.get(len(shape), tuple(f"a{i}" for i in range(len(shape))))
    names = tuple(str(a).strip() for a in axis_names)
    if len(names) != len(shape):
        raise PlanningError(f"{len(names)} axis names {list(names)} for a mesh of {len(shape)} axes {list(shape)}")
    return shape, _check_names(names)


def _check_shape(shape: tuple[int, ...]) -> None:
    if any(s < 1 for s in shape) or not shape:
        raise PlanningError(f"mesh shape {shape}: every axis needs a size >= 1")


def _check_names(names: tuple[str, ...]) -> tuple[str, ...]:
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PlanningError(f"mesh axis names {list(names)} repeat {', '.join(map(repr, repeated))}: every axis "
                            "needs a name of its own (e.g. data,model)")
    if any(not n for n in names):
        raise PlanningError(f"mesh axis names {list(names)}: an axis has an empty name")
    return names


def detect_hardware() -> str:
    """The preset of the devices JAX sees (the CPU profile shipped with cost_models on CPU)."""
    import jax

    kind = jax.devices()[0].device_kind.lower()
    for name in ("h200", "h100", "a100", "v100"):
        if name in kind:
            return name
    if jax.devices()[0].platform == "cpu":
        return "cpu-8dev-2026-11-21.json"
    log.warning("no preset for device kind %r; planning with the h100 preset", kind)
    return "h100"


def cost_model_for(hardware: HardwareLike, shape: tuple[int, ...], names: tuple[str, ...]) -> CostModel:
    """A cost model of ``hardware`` (a preset name, a profile file, ``"auto"``, or a CostModel) on a mesh."""
    if isinstance(hardware, CostModel):
        if hardware.mesh.shape == shape and hardware.mesh.axis_names == names:
            return hardware  # keep its links, which may have been set by hand
        return hardware.with_mesh(shape, names)
    if hardware == "auto":
        hardware = detect_hardware()
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


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> float:
    """``"80GiB"``, ``"16e9"``, ``"512 MB"`` -> bytes (kB/MB/GB/TB are powers of 1000, KiB... of 1024)."""
    m = _AMOUNT.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise PlanningError(f"memory budget {text!r}: give bytes per device as a number with an optional unit "
                            "(16e9, 80GiB, 512MB), 'auto' or 'none'")
    return float(m.group(1)) * _UNITS[unit]


def memory_budget_of(memory_budget: BudgetLike, capacity: float) -> float | None:
    """Bytes per device: a number of bytes, ``"auto"`` (``capacity`` less ``DEFAULT_MEMORY_MARGIN``), ``None``
    or ``"none"`` (no limit), or a string of bytes with an optional unit (``"16e9"``, ``"80GiB"``)."""
    if memory_budget is None or memory_budget == "none":
        return None
    if memory_budget == "auto":
        return capacity * (1 - DEFAULT_MEMORY_MARGIN)
    if isinstance(memory_budget, str):
        memory_budget = parse_bytes(memory_budget)
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int | float):
        raise PlanningError(f"memory budget {memory_budget!r}: give bytes per device, 'auto' or None")
    if not memory_budget > 0 or not math.isfinite(memory_budget):
        raise PlanningError(f"memory budget {memory_budget!r}: must be a positive, finite number of bytes per "
                            "device (or None for no limit)")
    return float(memory_budget)


def check_time_budget(seconds: float | None) -> float | None:
    """A solver time budget in seconds: positive and finite, or None (scaled to the step: ``planner.shares``)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not (0 < seconds < math.inf):
        raise PlanningError(f"time budget {seconds!r}: give a positive, finite number of seconds (e.g. 30), or "
                            "None to scale it to the step; the solver returns its best plan when it runs out")
    return float(seconds)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """The logical mesh, the hardware priced on it and the memory budget per device, resolved.

    ``hardware`` is the name plans record (a preset, a profile path); ``cost`` is the model on the mesh."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    hardware: str
    cost: CostModel
    memory_budget: float | None

    @classmethod
    def of(cls, mesh: MeshLike, hardware: HardwareLike = "h100", memory_budget: BudgetLike = "auto", *,
           axis_names: Sequence[str] | None = None) -> Target:
        """Resolve what a user wrote: see the module docstring."""
        shape, names = parse_mesh(mesh, axis_names)
        if hardware == "auto":
            hardware = detect_hardware()
        cost = cost_model_for(hardware, shape, names)
        name = hardware if isinstance(hardware, str) else cost.cluster.device.name
        return cls(shape=shape, axis_names=names, hardware=name, cost=cost,
                   memory_budget=memory_budget_of(memory_budget, cost.memory_capacity))

    @property
    def mesh(self) -> dict[str, int]:
        return dict(zip(self.axis_names, self.shape, strict=True))

    @property
    def spans_hosts(self) -> bool:
        """Whether the mesh holds more devices than one host of the hardware: then it runs from one process
        per host (``jax.distributed``), and a pipeline only as the SPMD program (``uniform_stages``)."""
        return math.prod(self.shape) > self.cost.cluster.devices_per_host


RUNTIMES = ("auto", "spmd", "mpmd")  # how a pipelined plan runs (``PlanOptions.runtime``: autoshard.options)


def uniform_stages(runtime: str, target: Target, processes: int = 1) -> bool:
    """Whether a pipeline is planned for the SPMD program (uniform stages, priced as its lockstep ticks run)
    rather than the single-process MPMD runtime (any stages): ``runtime`` ``"spmd"`` or ``"mpmd"`` as asked;
    ``"auto"``: SPMD when several processes run the step, or when the mesh spans hosts (planning ahead for
    a cluster, where one process per host runs it: the MPMD runtime dispatches every stage's programs
    from one process, which drives only its own host's devices)."""
    if runtime not in RUNTIMES:
        raise PlanningError(f"runtime={runtime!r} is not one of {', '.join(RUNTIMES)}")
    if runtime != "auto":
        return runtime == "spmd"
    return processes > 1 or target.spans_hosts


def runs_spmd(runtime: str, plan_spmd: bool, processes: int = 1) -> bool:
    """Whether a pipelined plan runs as the SPMD program (``pipeline.spmd_program``) rather than the MPMD
    runtime: ``runtime`` ``"spmd"`` or ``"mpmd"`` as asked; ``"auto"``: a plan made for the SPMD program
    (``PipelinePlan.spmd``: ``uniform_stages`` chose it when planning, the mesh spanning hosts included)
    runs as priced, and several processes always run it (the MPMD runtime drives one process's devices).
    The one run-time rule, beside ``uniform_stages``, the one planning rule: ``parallelize`` plans with
    ``runtime_options`` and runs with this, so a plan runs on the runtime it was priced for."""
    if runtime not in RUNTIMES:
        raise PlanningError(f"runtime={runtime!r} is not one of {', '.join(RUNTIMES)}")
    if runtime != "auto":
        return runtime == "spmd"
    return plan_spmd or processes > 1


def runtime_options(runtime: str, target: Target, processes: int = 1, schedule: str = "auto") -> dict[str, bool]:
    """``PipelineOptions``' fields for ``runtime``: ``uniform`` (``uniform_stages``), and ``spmd_if_faster``
    where ``"auto"`` leaves a single process the choice (the MPMD runtime's plan, and where its host work
    weighs, the SPMD program's too: ``choose.Choosing.plan_one``). A ``schedule`` only the SPMD program runs (ZB-V) makes
    ``"auto"`` the SPMD program."""
    uniform = uniform_stages(runtime, target, processes) or (runtime == "auto" and schedule in SPMD_ONLY)
    return {"uniform": uniform, "spmd_if_faster": runtime == "auto" and not uniform}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineOptions:
    """How a step may be pipelined.

    ``microbatches``: microbatches per step (None: no pipeline is planned); ``pipeline``: True always
    returns the pipelined plan, False never plans one, None returns the faster; ``schedule``: "auto" (the
    default: 1F1B or ZB-H1, whichever the planner prices faster on the stages it cuts), "1f1b", "gpipe",
    "zb-h1" (zero-bubble H1: weight gradients deferred into the bubbles), "interleaved-1f1b"
    (``num_chunks`` model chunks per stage; needs ``stage_shape``) or "zb-v" (zero-bubble V: two chunks a
    stage in a V, 1F1B's activation memory; the SPMD program only, ``uniform``); ``num_layers``: layers to cut the step into (default: one per named block, plus one);
    ``max_stages``: at most that many stages; ``stage_shape``: (hosts, devices) of every stage's submesh;
    ``uniform``: only stages the SPMD pipeline program runs (equal submeshes, the same number of blocks
    each), priced as that program runs them (``pipeline.stages._uniform``); ``spmd_if_faster``: a
    non-uniform plan for the single-process MPMD runtime whose host work (``pipeline.host``) is at least
    ``HOST_SHARE`` of its step is also planned for the SPMD program (one call a step), the faster kept."""

    microbatches: int | None = None
    pipeline: bool | None = None
    schedule: str = "auto"
    num_chunks: int = 2
    num_layers: int | None = None
    max_stages: int | None = None
    stage_shape: tuple[int, int] | None = None
    uniform: bool = False
    spmd_if_faster: bool = False

    def __post_init__(self) -> None:
        for name in ("microbatches", "num_layers", "max_stages", "num_chunks"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise PlanningError(f"{name}={v!r}: give a whole number >= 1, or None")
        if self.schedule not in (*SCHEDULES, "auto"):
            raise PlanningError(f"schedule {self.schedule!r}: the pipeline runtime runs {', '.join(SCHEDULES)}; "
                                "'auto' lets the planner pick")
        if self.pipeline and not self.microbatches:
            raise PlanningError("pipeline=True needs microbatches=B (the number of microbatches per step)")

    @property
    def planned(self) -> bool:
        """Whether a pipelined plan is made at all."""
        return bool(self.microbatches) and self.pipeline is not False
