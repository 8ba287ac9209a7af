"""A pipelined plan as plain data: ``StagePlan`` per stage, ``PipelinePlan`` for the step (JSON round-trip,
``verify()``), and ``PipelineReport``, how the stage planner got there."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autoshard.pipeline.partition import PipelineError
from autoshard.planner.plan import (
    InputSignature,
    PlanError,
    check_axes,
    check_inputs,
    specs_from_json,
    specs_to_json,
)
from autoshard.planner.utilization import ModelFlops
from autoshard.trace.graph import Graph, Scope
from cost_models import LogicalMesh, ShardingSpec
from solvers.pipeline.program import PipelineProgram, place
from solvers.pipeline.schedules import V_SCHEDULES, schedule

PIPELINE_PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelineReport:
    """How a pipelined plan was found. ``dp_cost``: the stage DP's objective (seconds); ``layer_solves``:
    intra-op solves spent pricing layers; ``distinct_layers``: layers with different ops; times in
    seconds; ``intra_op_step_time``: the best intra-operator plan's time when one was also planned (a
    string saying why there is none when it did not fit); ``schedules``: with the schedule left to the
    planner, the seconds each schedule it priced takes for the microbatches' passes (the update excluded)."""

    dp_cost: float
    layer_solves: int
    distinct_layers: int
    dp_seconds: float
    dp_candidates: int
    stage_costing_seconds: float
    planning_seconds: float
    intra_op_step_time: float | str | None = None
    schedules: Mapping[str, float] | None = None  # schedule "auto": each priced schedule's pipeline seconds
    cut_short: str | None = None  # what a spent time budget cut short (``planner.deadline``), for the summary

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PipelineReport:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: its layers, where it runs, what it costs, and its layouts (step tensor ids)."""

    layers: tuple[int, int]  # first, last (inclusive)
    submesh: tuple[int, int]  # (hosts, devices per host)
    origin: tuple[int, int]  # (first host, first device) of the submesh in the cluster
    mesh: LogicalMesh  # the logical mesh the stage was planned on
    micro_time: float  # seconds of forward + backward per microbatch, receiving its inputs included
    update_time: float  # seconds of the once-per-step update
    memory: float  # bytes per device: update state + in-flight microbatches' activations
    specs: Mapping[Scope, Mapping[int, ShardingSpec]]  # forward / backward programs
    update_specs: Mapping[Scope, Mapping[int, ShardingSpec]]
    # the recompute of the blocks in its layers, where stages chose their own (``stages``' recompute per stage)
    recompute: str = ""

    @property
    def num_devices(self) -> int:
        return self.submesh[0] * self.submesh[1]

    def devices(self, cluster: tuple[int, int]) -> list[int]:
        """Device indices (row-major over the cluster's (hosts, devices per host)) of this stage."""
        h0, d0 = self.origin
        return [h * cluster[1] + d for h in range(h0, h0 + self.submesh[0])
                for d in range(d0, d0 + self.submesh[1])]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PipelinePlan:
    """A pipelined plan as plain data: stages on submeshes, microbatches, schedule, predicted time.

    With ``num_chunks = v > 1`` (the interleaved schedule) ``stages`` are the ``V = v·S`` *virtual* stages
    in model order, each with its contiguous layers; virtual stage ``u`` runs on physical stage ``u mod S``
    (same submesh and origin), which so holds chunks ``u, u+S, ...``; under ZB-V (two chunks in a V) chunk 1
    of stage ``s`` is virtual stage ``2S − 1 − s`` (``place``)."""

    mesh: LogicalMesh
    hardware: str
    num_microbatches: int
    schedule: str
    num_layers: int
    stages: tuple[StagePlan, ...]
    layer_of_op: tuple[int, ...]  # per op of the microbatch-sized trace
    predicted_step_time: float
    bubble_fraction: float
    peak_memory: float
    memory_budget: float | None
    solver: PipelineReport
    graph_digest: str  # of the microbatch-sized trace the op ids refer to
    num_chunks: int = 1  # model chunks per physical stage (interleaved schedule); see the class docstring
    # 3x the whole step's forward matmul flops and their peak (``planner.utilization``); None: not recorded
    model_flops: ModelFlops | None = None
    # block (layer tag) -> recompute mode for the blocks the microbatch graph recomputes (``trace.remat``,
    # applied to the microbatch-sized trace before it is cut into stages); empty: as traced
    recompute: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (name, shape, dtype) of each input leaf of the microbatch-sized trace (``planner.plan.input_signature``);
    # empty in plans saved before it was recorded (``verify`` then compares the digest only)
    inputs: tuple[InputSignature, ...] = ()
    # planned for the SPMD program's fused 1F1B ticks (a forward and a backward a tick, ``ticks.fused_1f1b``):
    # its stages' memory holds that schedule's microbatches in flight
    fused_ticks: bool = False
    # planned for the SPMD program (``pipeline.spmd_program``: uniform stages, priced as its lockstep ticks
    # run), which runs on any number of processes; else for the single-process MPMD runtime
    spmd: bool = False
    # the SPMD program's tail (the layers after the blocks) spread over the last ``tail_split`` stages (in a
    # V, ZB-V's, the first: ``Ticks.tail_stages``), a slice of each microbatch's rows each
    # (``spmd_program.Spread``); ``tail_time``: its seconds (forward and backward of one microbatch, on the
    # last virtual stage's submesh), which that stage's ``micro_time`` includes and its ticks do not
    tail_split: int = 1
    tail_time: float = 0.0
    # the MPMD runtime's host seconds a step, issuing its programs and moving values between stages
    # (``pipeline.host``), which ``predicted_step_time`` includes where it bounds the step; 0: the SPMD
    # program (one call a step), or a plan saved before it was priced
    host_time: float = 0.0

    @property
    def mfu(self) -> float | None:
        """Predicted model FLOP utilization over the whole mesh (``planner.utilization``), or None."""
        return None if self.model_flops is None else self.model_flops.mfu(self.predicted_step_time,
                                                                          math.prod(self.mesh.shape))

    @property
    def num_physical_stages(self) -> int:
        return len(self.stages) // self.num_chunks

    def place(self, u: int) -> tuple[int, int]:
        """``(physical stage, chunk)`` of virtual stage ``u`` (``solvers.pipeline.program.place``; in a V for
        a schedule of ``V_SCHEDULES``)."""
        return place(u, self.num_physical_stages, self.schedule in V_SCHEDULES)

    @property
    def program(self) -> PipelineProgram:
        """The pipeline as one program (``solvers.pipeline``): every stage's actions in order, the one both
        runtimes run (the MPMD runtime follows its orders, the SPMD program its slots as lockstep ticks) and
        the planner priced. A pure function of the plan's schedule, stage, microbatch and chunk counts, fused
        ticks and tail spread (whose tick the program leaves free), so it is saved and loaded with them;
        built once for the same ones (``schedules.schedule``)."""
        return schedule(self.schedule, self.num_physical_stages, self.num_microbatches, self.num_chunks,
                        tail_gap=int(self.tail_split > 1), fused=self.fused_ticks)

    @property
    def cluster(self) -> tuple[int, int]:
        return cluster_of(self.mesh)

    def stage_of_op(self) -> tuple[int, ...]:
        stage_of_layer = {}
        for s, st in enumerate(self.stages):
            for layer in range(st.layers[0], st.layers[1] + 1):
                stage_of_layer[layer] = s
        return tuple(stage_of_layer[layer] for layer in self.layer_of_op)

    def verify(self, graph: Graph | None = None) -> None:
        """The stages cover the layers in order on the mesh's devices; with ``graph`` (the step traced at
        microbatch size), its input leaves have the planned shapes and dtypes (``check_inputs``) and its ops
        are those the plan cut into stages."""
        expect = 0
        for s, st in enumerate(self.stages):
            if st.layers[0] != expect or st.layers[1] < st.layers[0]:
                raise PlanError(f"stage {s} covers layers {st.layers}; expected to start at layer {expect}")
            expect = st.layers[1] + 1
        if expect != self.num_layers:
            raise PlanError(f"the stages cover layers 0..{expect - 1} of {self.num_layers}")
        S = self.num_physical_stages
        if self.num_chunks < 1 or len(self.stages) != S * self.num_chunks:
            raise PlanError(f"{len(self.stages)} virtual stages do not make {self.num_chunks} chunks per stage")
        for u, st in enumerate(self.stages[S:], start=S):
            here, chunk = self.place(u)
            first = self.stages[here]
            if (st.submesh, st.origin) != (first.submesh, first.origin):
                raise PlanError(f"virtual stage {u} runs on submesh {st.submesh} at {st.origin}; as chunk "
                                f"{chunk} of stage {here} it must run on {first.submesh} at {first.origin}")
        for s, st in enumerate(self.stages):
            check_axes(st.specs, st.mesh, f"stage {s}: ")
            check_axes(st.update_specs, st.mesh, f"stage {s}'s update: ")
        used = sum(st.num_devices for st in self.stages[:S])
        if used > math.prod(self.mesh.shape):
            raise PlanError(f"the stages use {used} devices; the mesh has {math.prod(self.mesh.shape)}")
        if not math.isfinite(self.predicted_step_time) or self.predicted_step_time < 0:
            raise PlanError(f"predicted step time {self.predicted_step_time} is not finite and non-negative")
        if graph is not None and self.inputs:
            check_inputs(self.inputs, graph, note=(
                f"\n(shapes at microbatch size: the step is traced with its batch split into {self.num_microbatches} "
                "microbatches)"))
        if graph is not None and (len(graph.ops) != len(self.layer_of_op)
                                  or graph_digest(graph) != self.graph_digest):
            raise PlanError("this pipeline plan was made for another trace of the step (different ops); "
                                "plan again")

    # ---- serialisation -----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "pipeline",
            "version": PIPELINE_PLAN_VERSION,
            "mesh": self.mesh.to_dict(),
            "hardware": self.hardware,
            "num_microbatches": self.num_microbatches,
            "schedule": self.schedule,
            "num_chunks": self.num_chunks,
            "num_layers": self.num_layers,
            "stages": [{
                "layers": list(st.layers), "submesh": list(st.submesh), "origin": list(st.origin),
                "mesh": st.mesh.to_dict(), "micro_time": st.micro_time, "update_time": st.update_time,
                "memory": st.memory, "specs": specs_to_json(st.specs),
                "update_specs": specs_to_json(st.update_specs),
                **({"recompute": st.recompute} if st.recompute else {}),
            } for st in self.stages],
            "layer_of_op": list(self.layer_of_op),
            "predicted_step_time": self.predicted_step_time,
            "bubble_fraction": self.bubble_fraction,
            "peak_memory": self.peak_memory,
            "memory_budget": self.memory_budget,
            "solver": self.solver.to_dict(),
            "graph_digest": self.graph_digest,
            **({} if self.model_flops is None else {"model_flops": self.model_flops.to_dict()}),
            "recompute": dict(self.recompute),
            "inputs": [{"name": n, "shape": list(shape), "dtype": dtype} for n, shape, dtype in self.inputs],
            **({"fused_ticks": True} if self.fused_ticks else {}),
            **({"spmd": True} if self.spmd else {}),
            **({"tail_split": self.tail_split, "tail_time": self.tail_time} if self.tail_split > 1 else {}),
            **({"host_time": self.host_time} if self.host_time else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PipelinePlan:
        if d.get("kind") != "pipeline" or d.get("version") != PIPELINE_PLAN_VERSION:
            raise PlanError(f"not a version-{PIPELINE_PLAN_VERSION} pipeline plan (kind={d.get('kind')!r}, "
                            f"version={d.get('version')!r})")
        stages = tuple(StagePlan(
            layers=tuple(s["layers"]), submesh=tuple(s["submesh"]), origin=tuple(s["origin"]),
            mesh=LogicalMesh.from_dict(s["mesh"]), micro_time=float(s["micro_time"]),
            update_time=float(s["update_time"]), memory=float(s["memory"]),
            specs=specs_from_json(s["specs"]), update_specs=specs_from_json(s["update_specs"]),
            recompute=str(s.get("recompute", "")),
        ) for s in d["stages"])
        plan = cls(mesh=LogicalMesh.from_dict(d["mesh"]), hardware=d["hardware"],
                   num_microbatches=int(d["num_microbatches"]), schedule=d["schedule"],
                   num_chunks=int(d.get("num_chunks", 1)),
                   num_layers=int(d["num_layers"]), stages=stages, layer_of_op=tuple(d["layer_of_op"]),
                   predicted_step_time=float(d["predicted_step_time"]),
                   bubble_fraction=float(d["bubble_fraction"]), peak_memory=float(d["peak_memory"]),
                   memory_budget=d["memory_budget"], solver=PipelineReport.from_dict(d["solver"]), graph_digest=d["graph_digest"],
                   model_flops=ModelFlops.from_dict(d["model_flops"]) if "model_flops" in d else None,
                   recompute=dict(d.get("recompute", {})),
                   inputs=tuple((x["name"], tuple(x["shape"]), x["dtype"]) for x in d.get("inputs", ())),
                   fused_ticks=bool(d.get("fused_ticks", False)), spmd=bool(d.get("spmd", False)),
                   tail_split=int(d.get("tail_split", 1)), tail_time=float(d.get("tail_time", 0.0)),
                   host_time=float(d.get("host_time", 0.0)))
        plan.verify()
        return plan

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> PipelinePlan:
        return cls.from_dict(json.loads(Path(path).read_text()))


def graph_digest(graph: Graph) -> str:
    h = hashlib.sha1()
    for op in graph.ops:
        h.update(op.primitive.encode())
        for t in (*op.inputs, *op.outputs):
            h.update(str(graph.tensors[t].shape).encode())
    return h.hexdigest()[:16]


def cluster_of(mesh: LogicalMesh) -> tuple[int, int]:
    if len(mesh.shape) == 1:
        return (1, mesh.shape[0])
    if len(mesh.shape) == 2:
        return (mesh.shape[0], mesh.shape[1])
    raise PipelineError(f"pipelines run on 1-D (devices) or 2-D (hosts x devices) meshes; got {mesh}")
