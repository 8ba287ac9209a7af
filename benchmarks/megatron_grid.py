"""The automatic GPT plan beside Megatron-style grid layouts, priced by the same model (issue #14).

A Megatron layout is ``t`` x ``d`` devices per pipeline stage (tensor x data parallel), ``p`` stages,
``B`` microbatches, 1F1B, with or without recompute. Each grid point is planned with the pipeline
planner pinned to that stage shape (``stage_shape=(1, t·d)`` or ``(t·d/8, 8)``), that microbatch count
and that recompute (``autoshard.megatron``, also ``autoshard compare --megatron``): the stage DP cuts the layers (balanced for identical blocks, as Megatron's uniform
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
import logging

from autoshard._examples import load_example
from autoshard.megatron import automatic_plan, grid_table, megatron_grid
from autoshard.target import Target


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
    p.add_argument("--schedules", nargs="+", default=["1f1b"])
    p.add_argument("--time-budget", type=float, default=40.0, help="seconds per grid point")
    p.add_argument("--no-auto", action="store_true", help="skip the automatic plan")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ex = load_example("examples/gpt.py", args.preset, [], abstract=True)
    target = Target.of(args.mesh, args.hardware, "auto")
    auto, t_auto, sp_auto = (None, 0.0, None) if args.no_auto else automatic_plan(ex.train_step, ex.args, target)
    points = megatron_grid(ex.train_step, ex.args, target, stage_shapes=[_shape(s) for s in args.shapes],
                           microbatches=args.microbatches, recompute=args.recompute, schedules=args.schedules,
                           time_budget_s=args.time_budget,
                           log=lambda pt: print(f"{pt.name}: {pt.step_time:.4g} s" if pt.plan else
                                                f"{pt.name}: {pt.error}", flush=True))
    print(f"\n{args.preset} on {args.mesh} {args.hardware}, batch {ex.config.batch} x {ex.config.seq_len}, "
          f"{ex.config.dtype}\n")
    print(grid_table(points, auto, t_auto, sp_auto))


if __name__ == "__main__":
    main()
