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
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

from autoshard.api import plan_for
from autoshard.errors import AutoshardError
from autoshard.pipeline import PipelinePlan
from autoshard.planner.plan import Plan
from autoshard.target import PipelineOptions, Target

__all__ = ["GridPoint", "automatic_plan", "default_stage_shapes", "grid_table", "megatron_grid"]


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


def automatic_plan(step_fn: Callable[..., Any], args: tuple[Any, ...], target: Target
                   ) -> tuple[PipelinePlan | Plan, float]:
    """The plan ``autoshard plan`` makes with only the target given, and the seconds it took."""
    t0 = time.perf_counter()
    plan, _, _ = plan_for(step_fn, args, target, PipelineOptions(), time_budget_s=None)
    return plan, time.perf_counter() - t0


def megatron_grid(step_fn: Callable[..., Any], args: tuple[Any, ...], target: Target, *,
                  stage_shapes: Sequence[tuple[int, int]] | None = None, microbatches: Sequence[int] = (64, 128),
                  recompute: Sequence[str] = ("none", "selective"), schedules: Sequence[str] = ("1f1b",),
                  num_chunks: int = 2, time_budget_s: float = 40.0,
                  log: Callable[[GridPoint], None] | None = None) -> list[GridPoint]:
    """Every (stage shape, microbatch count, schedule, recompute) point planned with the pipeline pinned
    to it, ``time_budget_s`` seconds each; points that cannot be planned (they do not fit, the mesh does
    not divide) are kept with their reason. ``log`` sees each point as it is priced."""
    shapes = list(stage_shapes) if stage_shapes else default_stage_shapes(target.cost.mesh.shape)
    out = []
    for shape in shapes:
        for count in microbatches:
            for schedule in schedules:
                for mode in recompute:
                    opts = PipelineOptions(microbatches=count, pipeline=True, stage_shape=tuple(shape),
                                           schedule=schedule, num_chunks=num_chunks)
                    t0 = time.perf_counter()
                    try:
                        plan, _, _ = plan_for(step_fn, args, target, opts, time_budget_s=time_budget_s,
                                              recompute=mode)
                        error = None
                    except AutoshardError as e:
                        plan, error = None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
                    point = GridPoint(tuple(shape), count, mode, schedule, plan, error, time.perf_counter() - t0)
                    out.append(point)
                    if log is not None:
                        log(point)
    return out


def _row(name: str, seconds: float, plan: PipelinePlan | Plan | None, error: str | None) -> str:
    if plan is None:
        return f"| {name} | {seconds:.0f} | {error} | | | | |"
    mfu = plan.mfu
    if isinstance(plan, PipelinePlan):
        shapes = "/".join(sorted({f"{s.submesh[0]}x{s.submesh[1]}" for s in plan.stages}))
        stages, bubble = f"{len(plan.stages)} x {shapes}", f"{100 * plan.bubble_fraction:.0f}%"
    else:
        stages, bubble = "intra-op", "-"
    return (f"| {name} | {seconds:.0f} | {plan.predicted_step_time:.4g} | "
            f"{'' if mfu is None else f'{100 * mfu:.1f}%'} | {stages} | {bubble} | {plan.peak_memory / 2**30:.1f} |")


def grid_table(points: Sequence[GridPoint], auto: PipelinePlan | Plan | None = None,
               auto_seconds: float = 0.0) -> str:
    """Markdown: the automatic plan (when given) and every grid point, then the best point against it."""
    lines = ["| layout | plan s | step s | MFU | stages | bubble | GiB/dev |",
             "|---|---:|---:|---:|---|---:|---:|"]
    if auto is not None:
        lines.append(_row("automatic", auto_seconds, auto, None))
    lines += [_row(p.name, p.seconds, p.plan, p.error) for p in points]
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
