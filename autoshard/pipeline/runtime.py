"""Run a pipelined step: per-stage programs on disjoint submeshes, microbatches in a schedule.

Each stage has up to three kinds of program (``partition.segments``): a forward and a backward program
run once per microbatch, and update programs run once per step. Every program is the step's own ops
re-bound by the emitter's interpreter under one ``jax.jit`` on the stage's submesh, with the stage's
intra-op layouts as in/out shardings and sharding constraints.

One call of the step:

1. split every batch input along dimension 0 into ``B`` equal microbatches;
2. walk the schedule (``autoshard.pipeline.schedules``) slot by slot; an action ``(stage, microbatch,
   forward|backward)`` gathers its program's inputs (step inputs, that microbatch's slice, or values other
   programs produced for that microbatch), moves each onto the stage's submesh in the layout the program
   wants (``jax.device_put``: a copy between device sets, a reshard within one), and calls the program;
   values leaving the microbatched part are summed into per-stage accumulators. Partial sums over the
   stage's data-parallel axes (its gradients, mostly) leave the programs *unreduced*, stacked along a
   leading dimension split over those axes (``autoshard.pipeline.unreduced``), and are summed as they are:
   no communication per microbatch;
3. reduce once per step: each stage's ``Reduction`` program sums the stacked dimension of its
   accumulators (one all-reduce, or a reduce-scatter where the update reads a sharded layout) and divides
   by ``B`` (the mean over microbatches, see ``partition``); the other accumulators are divided by ``B``;
   then run the update programs in level order;
4. return the step's results in the traced output structure.

JAX dispatches asynchronously, so a stage's program is queued as soon as its inputs are; stages on
different devices overlap the way the schedule intends without any thread of ours. Values of one
microbatch are dropped as soon as the last program that reads them has been queued.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from autoshard.emit.specs import normalize_key
from autoshard.pipeline.draws import row_draws, top_op
from autoshard.pipeline.partition import (
    UPDATE,
    WEIGHT,
    PipelineError,
    Segment,
    StepParts,
    segments,
    split_step,
)
from autoshard.pipeline.pipeline_plan import PipelinePlan
from autoshard.pipeline.schedules import V_SCHEDULES, Schedule
from autoshard.pipeline.unreduced import UnreducedInterpreter, plan_stacked, stacked_size
from autoshard.trace.graph import Graph, Scope
from cost_models import ShardingSpec

SpecMap = Mapping[Scope, Mapping[int, ShardingSpec]]


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Program:
    segment: Segment
    mesh: jax.sharding.Mesh
    in_shardings: tuple[NamedSharding, ...]
    out_shardings: tuple[NamedSharding, ...]
    jitted: Any
    stacked: Mapping[int, tuple[str, ...]]  # outputs returned as stacked partial sums -> their axes
    indexed: bool = False  # takes the microbatch's index first (its draws over the rows: ``pipeline.draws``)


def _build_program(graph: Graph, seg: Segment, mesh: jax.sharding.Mesh, specs: SpecMap,
                   keep: Collection[int] = (), draws: frozenset[tuple[Scope, int]] = frozenset()) -> Program:
    """One stage program; a per-microbatch one returns the partial sums among ``keep`` (accumulated
    results no other per-microbatch program reads) stacked, unreduced (``unreduced``). One running some of
    ``draws`` (``pipeline.draws.row_draws``) takes the microbatch's index as its first argument and draws
    that microbatch's rows of jax.jit's numbers."""
    specs = {normalize_key(k): dict(v) for k, v in specs.items()}  # pending sums: emission pins dims only
    top = specs.get((), {})
    ops = [graph.ops[i] for i in seg.ops]
    stacked, producers = ({}, {}) if seg.kind == UPDATE else plan_stacked(graph, ops, top, keep)
    interp = UnreducedInterpreter(mesh, specs, stacked, producers)

    def sharding(tid: int) -> NamedSharding:
        if tid in stacked:
            return interp.stacked_sharding(tid)
        spec = top.get(tid)
        return interp.sharding(spec) if spec is not None else NamedSharding(mesh, PartitionSpec())

    ins = tuple(sharding(t) for t in seg.inputs)
    outs = tuple(sharding(t) for t in seg.outputs)
    mine = set(seg.ops)
    interp.draws = frozenset(d for d in draws if top_op(d) in mine)
    indexed = bool(interp.draws) and seg.kind != UPDATE

    def fn(*args: Any) -> tuple[Any, ...]:
        interp.reset()
        if indexed:
            interp.block, args = args[0], args[1:]
        return tuple(interp.run_ops(graph, ops, seg.inputs, args, seg.outputs))

    whole = NamedSharding(mesh, PartitionSpec())
    return Program(segment=seg, mesh=mesh, in_shardings=ins, out_shardings=outs,
                   stacked={t: stacked[t] for t in seg.outputs if t in stacked},
                   jitted=jax.jit(fn, in_shardings=((whole,) if indexed else ()) + ins, out_shardings=outs),
                   indexed=indexed)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Reduction:
    """A stage's once-per-step reduction: the sum over the stacked dimension of each accumulated partial
    sum, divided by ``B``, laid out as the update reads it (one all-reduce or reduce-scatter each)."""

    tensors: tuple[int, ...]
    in_shardings: tuple[NamedSharding, ...]  # the stacked layouts the per-microbatch programs return
    jitted: Any


def _reduction(tids: Sequence[int], ins: Sequence[NamedSharding], targets: Sequence[NamedSharding],
               num_microbatches: int) -> Reduction:
    def fn(*xs: Any) -> tuple[Any, ...]:
        return tuple((jnp.sum(x, axis=0) / jnp.asarray(num_microbatches, x.dtype)).astype(x.dtype) for x in xs)

    return Reduction(tensors=tuple(tids), in_shardings=tuple(ins),
                     jitted=jax.jit(fn, in_shardings=tuple(ins), out_shardings=tuple(targets)))


class PipelinedStep:
    """A traced step (at microbatch size) run as a pipeline; call it with the full batch.

    ``stage_meshes[s]``: the submesh of stage ``s`` (Auto axes); ``stage_specs[s]``: the layouts its
    programs pin, keyed like an emitter spec map with the step's tensor ids (forward/backward and update
    programs may use separate maps: ``update_specs``); ``stage_of_op``: the stage of every op. Under an
    interleaved schedule these are per *virtual* stage ``u = chunk·S + s`` (``schedules``), and the
    schedule's action ``(s, chunk)`` runs virtual stage ``u``'s program on ``stage_meshes[u]`` (the
    submesh of physical stage ``s``).
    """

    def __init__(self, graph: Graph, parts: StepParts, stage_of_op: Sequence[int], segments: Sequence[Segment],
                 stage_meshes: Sequence[jax.sharding.Mesh], stage_specs: Sequence[SpecMap],
                 schedule: Schedule, *, update_specs: Sequence[SpecMap] | None = None,
                 draws: frozenset[tuple[Scope, int]] = frozenset()) -> None:
        if graph.in_tree is None or graph.out_tree is None:
            raise PipelineError("a pipelined step needs a top-level Graph from autoshard.trace")
        if any(seg.kind == WEIGHT for seg in segments) and not schedule.weight_pass:
            raise PipelineError(f"the backward programs are split into input- and weight-gradient parts but "
                                f"schedule {schedule.name!r} has no weight pass: build the segments without "
                                "split_weight, or use 'zb-h1'")
        if schedule.num_virtual_stages != len(stage_meshes):
            raise PipelineError(f"the schedule has {schedule.num_stages} stages of {schedule.num_chunks} model "
                                f"chunk(s) each, so it needs {schedule.num_virtual_stages} (virtual) stage "
                                f"submeshes; {len(stage_meshes)} were given")
        self.graph = graph
        self.parts = parts
        self.schedule = schedule
        self.num_microbatches = schedule.num_microbatches
        self.stage_meshes = tuple(stage_meshes)
        update_specs = update_specs or stage_specs
        micro_reads = {t for seg in segments if seg.kind != UPDATE for t in seg.inputs}
        keep = set(parts.accumulated) - micro_reads
        self.programs: dict[tuple[int, str, int], Program] = {}
        for seg in segments:
            specs = update_specs[seg.stage] if seg.kind == UPDATE else stage_specs[seg.stage]
            self.programs[(seg.stage, seg.kind, seg.level)] = _build_program(
                graph, seg, stage_meshes[seg.stage], specs, keep, draws)
        self._indices: dict[tuple[int, jax.sharding.Mesh], Any] = {}  # microbatch indices, placed once
        self.update_order = [p for k, p in sorted(self.programs.items(), key=lambda kv: (kv[0][2], kv[0][0]))
                             if k[1] == UPDATE]
        self._batch = {graph.inputs[i] for i in parts.batch_inputs}
        self._step_inputs = set(graph.inputs)
        self._accumulated = set(parts.accumulated)
        # how many per-microbatch programs read each microbatched value (to free it after the last)
        reads: dict[int, int] = defaultdict(int)
        for (_, kind, _), prog in self.programs.items():
            if kind != UPDATE:
                for t in prog.segment.inputs:
                    if t not in self._step_inputs:
                        reads[t] += 1
        self._reads = dict(reads)
        # per stage, the accumulated partial sums carried stacked and where the update reads each
        readers: dict[int, NamedSharding] = {}
        for prog in self.update_order:
            for t, sh in zip(prog.segment.inputs, prog.in_shardings, strict=True):
                readers.setdefault(t, sh)
        stacked: dict[int, list[tuple[int, NamedSharding, NamedSharding]]] = defaultdict(list)
        for (stage, kind, _), prog in self.programs.items():
            if kind == UPDATE:
                continue
            here = NamedSharding(prog.mesh, PartitionSpec())
            for t in sorted(prog.stacked):
                target = sh if (sh := readers.get(t)) is not None and sh.mesh == prog.mesh else here
                stacked[stage].append((t, prog.out_shardings[prog.segment.outputs.index(t)], target))
        self.reductions = {s: _reduction([t for t, _, _ in v], [i for _, i, _ in v], [o for _, _, o in v],
                                         self.num_microbatches) for s, v in stacked.items()}

    # ---- one step ------------------------------------------------------------------------------------------

    def _split(self, leaves: list[Any]) -> dict[int, list[Any]]:
        B = self.num_microbatches
        micro: dict[int, list[Any]] = {}
        for i in self.parts.batch_inputs:
            tid = self.graph.inputs[i]
            x = leaves[i]
            t = self.graph.tensors[tid]
            if x.shape[0] != B * t.shape[0]:
                raise PipelineError(
                    f"batch input {t.name!r} has {x.shape[0]} rows; the pipeline was traced with microbatches "
                    f"of {t.shape[0]} rows and {B} microbatches, so it needs {B * t.shape[0]}")
            micro[tid] = [x[m * t.shape[0]:(m + 1) * t.shape[0]] for m in range(B)]
        return micro

    def _index(self, m: int, mesh: jax.sharding.Mesh) -> Any:
        """Microbatch ``m``'s index on ``mesh``'s devices (an indexed program's first argument)."""
        key = (m, mesh)
        if key not in self._indices:
            self._indices[key] = jax.device_put(np.int32(m), NamedSharding(mesh, PartitionSpec()))
        return self._indices[key]

    def compiled_text(self, stage: int, kind: str, level: int = 0) -> str:
        """The compiled HLO of one program (``kind`` "forward", "backward", "update" or "reduce"), compiled
        from abstract inputs: where the collectives are (they show only in compiled text)."""
        tensors = self.graph.tensors
        if kind == "reduce":
            red = self.reductions[stage]
            avals = [jax.ShapeDtypeStruct((_stacked_rows(sh), *tensors[t].shape),
                                          tensors[t].dtype, sharding=sh)
                     for t, sh in zip(red.tensors, red.in_shardings, strict=True)]
            return red.jitted.lower(*avals).compile().as_text()
        prog = self.programs[(stage, kind, level)]
        avals = [jax.ShapeDtypeStruct(tensors[t].shape, tensors[t].dtype, sharding=sh)
                 for t, sh in zip(prog.segment.inputs, prog.in_shardings, strict=True)]
        if prog.indexed:
            avals.insert(0, jax.ShapeDtypeStruct((), np.int32, sharding=NamedSharding(prog.mesh, PartitionSpec())))
        return prog.jitted.lower(*avals).compile().as_text()

    def __call__(self, *args: Any) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(args)
        if len(leaves) != len(self.graph.inputs):
            raise PipelineError(f"the step takes {len(self.graph.inputs)} array leaves, got {len(leaves)} "
                                f"(traced structure: {self.graph.in_tree}, given: {tree})")
        graph = self.graph
        step: dict[int, Any] = dict(zip(graph.inputs, leaves, strict=True))
        micro = self._split(leaves)
        values: dict[tuple[int, int], Any] = {}
        pending: dict[tuple[int, int], int] = {}
        acc: dict[int, Any] = {}
        placed: dict[tuple[int, NamedSharding], Any] = {}

        def fetch(tid: int, m: int, sharding: NamedSharding) -> Any:
            if tid in micro:
                x = micro[tid][m]
            elif tid in self._step_inputs:
                key = (tid, sharding)
                if key not in placed:
                    placed[key] = _put(step[tid], sharding)
                return placed[key]
            else:
                x = values[(tid, m)]
                left = pending[(tid, m)] - 1
                if left:
                    pending[(tid, m)] = left
                else:
                    del pending[(tid, m)]
                    del values[(tid, m)]
            return _put(x, sharding)

        for slot in self.schedule.slots:
            for action in slot:
                prog = self.programs.get((action.virtual_stage(self.schedule.num_stages), action.kind, 0))
                if prog is None:
                    continue
                m = action.microbatch
                seg = prog.segment
                ins = [fetch(t, m, s) for t, s in zip(seg.inputs, prog.in_shardings, strict=True)]
                if prog.indexed:
                    ins.insert(0, self._index(m, prog.mesh))
                outs = prog.jitted(*ins)
                for tid, x in zip(seg.outputs, outs, strict=True):
                    if tid in self._accumulated:
                        if tid not in acc:
                            acc[tid] = x
                        elif jnp.issubdtype(x.dtype, jnp.inexact):
                            acc[tid] = acc[tid] + x
                        # integer results (counters) are the same for every microbatch: keep the first
                    if self._reads.get(tid):
                        values[(tid, m)] = x
                        pending[(tid, m)] = self._reads[tid]
        if values:
            names = sorted({graph.tensors[t].name for t, _ in values})[:5]
            raise PipelineError(f"values produced but never read by the schedule's programs: {names}")
        B = self.num_microbatches
        for red in self.reductions.values():
            for tid, x in zip(red.tensors, red.jitted(*(acc.pop(t) for t in red.tensors)), strict=True):
                step[tid] = x
        for tid, x in acc.items():
            step[tid] = _mean(x, B)
        for prog in self.update_order:
            seg = prog.segment
            ins = [_put(step[t], s) for t, s in zip(seg.inputs, prog.in_shardings, strict=True)]
            for tid, x in zip(seg.outputs, prog.jitted(*ins), strict=True):
                step[tid] = x
        missing = [graph.output_names[o] for o, t in enumerate(graph.outputs) if t not in step]
        if missing:
            raise PipelineError(f"the pipeline produced no value for the step results {missing[:5]}")
        return jax.tree_util.tree_unflatten(graph.out_tree, [step[t] for t in graph.outputs])


def _put(x: Any, sharding: NamedSharding) -> Any:
    """``x`` laid out as ``sharding``: as it is when it already is (a stage's own residuals, parameters an
    update left in the layout the forward reads), else by ``jax.device_put``, which costs the host about as
    much as a program call (``pipeline.host``)."""
    return x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)


def _stacked_rows(sharding: NamedSharding) -> int:
    """``D`` of a stacked layout: the product of the mesh axes its leading dimension is split over."""
    lead = sharding.spec[0] if len(sharding.spec) else None
    axes = () if lead is None else (lead,) if isinstance(lead, str) else tuple(lead)
    return stacked_size(sharding.mesh, axes)


@jax.jit
def _mean_impl(x: Any, b: Any) -> Any:
    return (x / b).astype(x.dtype)


def _mean(x: Any, b: int) -> Any:
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return _mean_impl(x, jnp.asarray(b, x.dtype))
    return x


def build_pipelined_step(graph: Graph, plan: PipelinePlan, devices: Sequence[jax.Device],
                         full: Graph | None = None) -> PipelinedStep:
    """The runnable pipeline of ``plan`` for ``graph`` (the step traced at microbatch size) on ``devices``
    (row-major over the plan's cluster of (hosts, devices per host)). With ``full`` (the step traced at full
    size), its random draws over the batch's rows draw jax.jit's numbers (``pipeline.draws``); without, every
    microbatch draws the first microbatch's."""
    plan.verify(graph)
    if plan.schedule in V_SCHEDULES:
        raise PipelineError(f"the plan's {plan.schedule!r} schedule runs its chunks in a V, which only the SPMD "
                            "program runs (runtime='spmd'); the MPMD runtime runs 1f1b, gpipe, zb-h1 and "
                            "interleaved-1f1b")
    cluster = plan.cluster
    if len(devices) < cluster[0] * cluster[1]:
        raise PipelineError(f"the plan's cluster {cluster[0]}x{cluster[1]} needs {cluster[0] * cluster[1]} "
                            f"devices; {len(devices)} given")
    parts = split_step(graph)
    stage_of = plan.stage_of_op()
    S = plan.num_physical_stages
    physical = [stage_mesh([devices[i] for i in st.devices(cluster)], st.mesh.shape, st.mesh.axis_names)
                for st in plan.stages[:S]]
    meshes = [physical[u % S] for u in range(len(plan.stages))]  # virtual stage u runs on stage u mod S
    sched = plan.program
    draws = row_draws(graph, full, plan.num_microbatches) if full is not None else None
    return PipelinedStep(graph, parts, stage_of, segments(graph, parts, stage_of, split_weight=sched.weight_pass),
                         meshes, [st.specs for st in plan.stages], sched,
                         update_specs=[st.update_specs for st in plan.stages], draws=draws or frozenset())


def stage_mesh(devices: Sequence[jax.Device], shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A submesh with Auto axes over ``devices`` (row-major into ``shape``)."""
    import numpy as np

    arr = np.array(list(devices), dtype=object).reshape(shape)
    return jax.sharding.Mesh(arr, names)

