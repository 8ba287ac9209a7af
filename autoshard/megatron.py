"""Megatron-style layouts of a pipelined step, priced by the planner beside its automatic plan.

A Megatron layout (Narayanan et al., SC'21) is ``p`` pipeline stages of ``t x d`` devices each (tensor x
data parallel inside a stage), ``B`` microbatches, a schedule (1F1B, or interleaved with ``v`` chunks per
stage) and activation recompute (none, selective, full). Each grid point here is the pipeline planner
pinned to that stage submesh (``stage_shape``), microbatch count, schedule and recompute: the stage DP
cuts the layers (balanced for identical blocks, as Megatron's uniform split) and the intra-op solver lays
out each stage, so a point gets the best completion of its shape the solver finds (at least ``t``-way
tensor and ``d``-way data parallel inside a stage when that is the cheaper). All prices come from the
same cost model as the automatic plan: a user sees the automatic plan beside the best hand layout, and
where it is slower the grid says by how much (``autoshard compare --megatron``).

Megatron's GPT-1T layouts are two points of the grid: the 2021 one (Narayanan et al.: ``t = 8``, ``p = 64``,
``d = 6``, interleaved, full recompute) and the 2022 one (Korthikanti et al.: the same with sequence
parallelism and selective recompute)::

    autoshard compare examples/gpt.py --preset 1t --mesh 384x8 --hardware a100 --megatron \
        --stage-shapes 6x8 --microbatches 512 --schedules interleaved-1f1b --recompute full selective

Sequence parallelism is a layout of activations, not an option: the intra-op solver lays the norms and
residual adds out along the sequence when that is cheaper or when memory binds (``tests/test_sequence_parallel.py``).
The table's ``SP`` column says how much of each plan did (``sequence_parallel``): the share of its
LayerNorms' forward reductions whose input is split along the sequence; a 2022 point without it is the
2021 layout with selective recompute, not Megatron's 2022 one.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoshard.api import plan_for
from autoshard.errors import AutoshardError
from autoshard.pipeline import PipelinePlan
from autoshard.planner.plan import Plan
from autoshard.target import PipelineOptions, Target, runtime_options
from autoshard.trace.graph import Graph

__all__ = ["GridPoint", "automatic_plan", "default_stage_shapes", "grid_table", "megatron_grid", "sequence_parallel"]


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One hand layout and its price (``plan``), or why it has none (``error``: it does not fit, ...)."""

    stage_shape: tuple[int, int]
    microbatches: int
    recompute: str
    schedule: str
    plan: PipelinePlan | Plan | None
    error: str | None
    seconds: float
    sequence_parallel: float | None = None  # ``sequence_parallel`` of the plan

    @property
    def name(self) -> str:
        h, d = self.stage_shape
        return f"stage {h}x{d}, B={self.microbatches}, {self.schedule}, recompute {self.recompute}"

    @property
    def step_time(self) -> float:
        return float("inf") if self.plan is None else self.plan.predicted_step_time


def default_stage_shapes(mesh_shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Megatron's usual stage submeshes on ``hosts x devices``: one host (``t x d = devices``), half a
    host and two hosts, the ones the mesh holds a whole number of."""
    hosts, devices = (1, mesh_shape[0]) if len(mesh_shape) == 1 else (mesh_shape[0], mesh_shape[-1])
    out = [(1, devices)]
    if devices % 2 == 0 and devices >= 2:
        out.append((1, devices // 2))
    if hosts % 2 == 0:
        out.append((2, devices))
    return out


_NORM = re.compile(r"(^|/)(ln[^/]*|[^/]*norm[^/]*)$", re.IGNORECASE)


def sequence_parallel(graph: Graph, plan: PipelinePlan | Plan) -> float | None:
    """The share of the LayerNorms (ops in a scope named ``ln*`` or ``*norm*``) whose forward reductions
    over the hidden dimension read a ``[batch, seq, hidden]`` input split along the sequence, in the
    layouts ``plan`` gives ``graph`` (the trace it planned: for a pipeline, at microbatch size); None when
    the step has none. 1.0 is Megatron's sequence parallelism everywhere, 0.0 nowhere."""
    tables = [s.specs.get((), {}) for s in plan.stages] if isinstance(plan, PipelinePlan) else [plan.specs.get((), {})]
    seen = split = 0
    for op in graph.ops:
        if op.phase != "forward" or op.primitive != "reduce_sum" or not _NORM.search(op.scope):
            continue
        tid = op.inputs[0]
        shape = graph.tensors[tid].shape
        if len(shape) != 3 or tuple(op.eqn.params["axes"]) != (2,):
            continue
        spec = next((t[tid] for t in tables if tid in t), None)
        if spec is not None and len(spec.dims) == 3:
            seen += 1
            split += bool(spec.dims[1])
    return split / seen if seen else None


def automatic_plan(step_fn: Callable[..., Any], args: tuple[Any, ...], target: Target, runtime: str = "auto"
                   ) -> tuple[PipelinePlan | Plan, float, float | None]:
    """The plan ``autoshard plan`` makes with only the target (and ``runtime``, ``target.RUNTIMES``) given,
    the seconds it took and its ``sequence_parallel`` share."""
    t0 = time.perf_counter()
    options = PipelineOptions(**runtime_options(runtime, target))
    plan, planned, micro = plan_for(step_fn, args, target, options, time_budget_s=None)
    seconds = time.perf_counter() - t0
    return plan, seconds, sequence_parallel(micro if micro is not None else planned, plan)


def megatron_grid(step_fn: Callable[..., Any], args: tuple[Any, ...], target: Target, *,
                  stage_shapes: Sequence[tuple[int, int]] | None = None, microbatches: Sequence[int] = (64, 128),
                  recompute: Sequence[str] = ("none", "selective"), schedules: Sequence[str] = ("1f1b",),
                  num_chunks: int = 2, time_budget_s: float = 40.0, runtime: str = "auto",
                  log: Callable[[GridPoint], None] | None = None) -> list[GridPoint]:
    """Every (stage shape, microbatch count, schedule, recompute) point planned with the pipeline pinned
    to it, ``time_budget_s`` seconds each, for the pipeline runtime ``runtime`` (``target.RUNTIMES``; as
    ``automatic_plan`` is, so that the two are priced alike: GPT-1T's Megatron 2022 layout on 384x8 at an
    80 GB budget prices 80.4 s for the MPMD runtime and 100.9 s for the SPMD program's lockstep ticks);
    points that cannot be planned (they do not fit, the mesh does not divide) are kept with their reason.
    ``log`` sees each point as it is priced."""
    runtime_fields = runtime_options(runtime, target)
    shapes = list(stage_shapes) if stage_shapes else default_stage_shapes(target.cost.mesh.shape)
    out = []
    for shape in shapes:
        for count in microbatches:
            for schedule in schedules:
                for mode in recompute:
                    opts = PipelineOptions(microbatches=count, pipeline=True, stage_shape=tuple(shape),
                                           schedule=schedule, num_chunks=num_chunks, **runtime_fields)
                    t0 = time.perf_counter()
                    share = None
                    try:
                        plan, planned, micro = plan_for(step_fn, args, target, opts, time_budget_s=time_budget_s,
                                                        recompute=mode)
                        error = None
                        share = sequence_parallel(micro if micro is not None else planned, plan)
                    except AutoshardError as e:
                        plan, error = None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    point = GridPoint(tuple(shape), count, mode, schedule, plan, error, time.perf_counter() - t0,
                                      share)
                    out.append(point)
                    if log is not None:
                        log(point)
    return out


def _row(name: str, seconds: float, plan: PipelinePlan | Plan | None, error: str | None,
         share: float | None = None) -> str:
    if plan is None:
        return f"| {name} | {seconds:.0f} | {error} | | | | | |"
    mfu = plan.mfu
    if isinstance(plan, PipelinePlan):
        shapes = "/".join(sorted({f"{s.submesh[0]}x{s.submesh[1]}" for s in plan.stages}))
        stages, bubble = f"{len(plan.stages)} x {shapes}", f"{100 * plan.bubble_fraction:.0f}%"
    else:
        stages, bubble = "intra-op", "-"
    return (f"| {name} | {seconds:.0f} | {plan.predicted_step_time:.4g} | "
            f"{'' if mfu is None else f'{100 * mfu:.1f}%'} | {stages} | {bubble} | {plan.peak_memory / 2**30:.1f} | "
            f"{'-' if share is None else f'{100 * share:.0f}%'} |")


def grid_table(points: Sequence[GridPoint], auto: PipelinePlan | Plan | None = None,
               auto_seconds: float = 0.0, auto_sequence_parallel: float | None = None) -> str:
    """Markdown: the automatic plan (when given) and every grid point, then the best point against it.
    ``SP``: the share of the norms laid out sequence-parallel (``sequence_parallel``)."""
    lines = ["| layout | plan s | step s | MFU | stages | bubble | GiB/dev | SP |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]
    if auto is not None:
        lines.append(_row("automatic", auto_seconds, auto, None, auto_sequence_parallel))
    lines += [_row(p.name, p.seconds, p.plan, p.error, p.sequence_parallel) for p in points]
    priced = [p for p in points if p.plan is not None]
    if priced:
        best = min(priced, key=lambda p: p.step_time)
        lines.append("")
        lines.append(f"best grid point: {best.name}, {best.step_time:.4g} s a step")
        if auto is not None:
            ratio = auto.predicted_step_time / best.step_time
            verdict = "faster than" if ratio < 1 else "as fast as" if ratio == 1 else "slower than"
            lines.append(f"automatic plan: {auto.predicted_step_time:.4g} s a step, {verdict} the best grid "
                         f"point (automatic / best = {ratio:.3f})")
    else:
        lines += ["", "no grid point could be planned (see the reasons above)"]
    return "\n".join(lines)
