"""The automatic GPT plan beside Megatron-style grid layouts, priced by the same model (issue #14).

A Megatron layout is ``t`` x ``d`` devices per pipeline stage (tensor x data parallel), ``p`` stages,
``B`` microbatches, 1F1B, with or without recompute. Each grid point is planned with the pipeline
planner pinned to that stage shape (``stage_shape=(1, t·d)`` or ``(t·d/8, 8)``), that microbatch count
and that recompute: the stage DP cuts the layers (balanced for identical blocks, as Megatron's uniform
split) and the intra-op solver lays out each stage, so a grid point gets the best completion of its
shape the solver finds (at least Megatron's t-way tensor parallel and d-way data parallel inside the
stage when that is cheaper, as ``autoshard compare`` does for intra-op layouts). The automatic plan is
``autoshard plan`` with only the mesh given. Prints a markdown table; predicted times, not measured:

    python benchmarks/megatron_grid.py                        # GPT-39B, batch 1024, 8x8 H100
    python benchmarks/megatron_grid.py --shapes 1x8 1x4 --microbatches 128 --recompute none

Model flops per step are 3x the forward matmuls (``planner.utilization``); MFU against the bf16 peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time

from autoshard._examples import load_example
from autoshard.api import plan_for
from autoshard.pipeline import PipelinePlan
from autoshard.target import PipelineOptions, Target


def _shape(text: str) -> tuple[int, int]:
    h, d = (int(x) for x in text.split("x"))
    return h, d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="39b")
    p.add_argument("--mesh", default="8x8")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--shapes", nargs="+", default=["1x8", "1x4", "2x8", "1x2"], help="stage submeshes HxD")
    p.add_argument("--microbatches", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--recompute", nargs="+", default=["none", "selective"])
    p.add_argument("--time-budget", type=float, default=40.0, help="seconds per grid point")
    p.add_argument("--no-auto", action="store_true", help="skip the automatic plan")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ex = load_example("examples/gpt.py", args.preset, [], abstract=True)
    target = Target.of(args.mesh, args.hardware, "auto")
    rows = []
    if not args.no_auto:
        t0 = time.perf_counter()
        auto, _, _ = plan_for(ex.train_step, ex.args, target, PipelineOptions(), time_budget_s=None)
        rows.append(("auto", time.perf_counter() - t0, auto))
    for shape in args.shapes:
        for count in args.microbatches:
            for mode in args.recompute:
                opts = PipelineOptions(microbatches=count, pipeline=True, stage_shape=_shape(shape))
                name = f"stage {shape}, B={count}, recompute {mode}"
                t0 = time.perf_counter()
                try:
                    plan, _, _ = plan_for(ex.train_step, ex.args, target, opts, time_budget_s=args.time_budget,
                                          recompute=mode)
                except Exception as e:  # a grid point that does not fit is a row too
                    rows.append((name, time.perf_counter() - t0, f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"))
                else:
                    rows.append((name, time.perf_counter() - t0, plan))
                print(_row(*rows[-1]), flush=True)
    print(f"\n{args.preset} on {args.mesh} {args.hardware}, batch {ex.config.batch} x {ex.config.seq_len}, "
          f"{ex.config.dtype}\n")
    print("| layout | plan s | step s | MFU | stages | bubble | GiB/dev |\n|---|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(_row(*r))
    ok = [(n, x) for n, _, x in rows[1:] if not isinstance(x, str)]
    if ok and not args.no_auto and not isinstance(rows[0][2], str):
        name, best = min(ok, key=lambda nx: nx[1].predicted_step_time)
        print(f"\nbest grid point: {name}, {best.predicted_step_time:.3f} s; automatic "
              f"{rows[0][2].predicted_step_time:.3f} s (auto / best grid = "
              f"{rows[0][2].predicted_step_time / best.predicted_step_time:.3f})")


def _row(name: str, seconds: float, plan: object) -> str:
    if isinstance(plan, str):
        return f"| {name} | {seconds:.0f} | {plan} | | | | |"
    assert dataclasses.is_dataclass(plan)
    mfu = getattr(plan, "mfu", None)
    stages = (f"{len(plan.stages)} x " + "/".join(sorted({f'{s.submesh[0]}x{s.submesh[1]}' for s in plan.stages}))
              if isinstance(plan, PipelinePlan) else "intra-op")
    bubble = f"{100 * plan.bubble_fraction:.0f}%" if isinstance(plan, PipelinePlan) else "-"
    return (f"| {name} | {seconds:.0f} | {plan.predicted_step_time:.3f} | "
            f"{'' if mfu is None else f'{100 * mfu:.1f}%'} | {stages} | {bubble} | {plan.peak_memory / 2**30:.1f} |")


if __name__ == "__main__":
    main()
