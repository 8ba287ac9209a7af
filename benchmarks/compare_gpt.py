"""Automatic plan versus the best hand-written layout (issue #6's benchmark): GPT presets on a logical mesh.

For each preset, the automatic plan and every layout of ``autoshard.planner.layouts.grid`` (dp x tp over
the mesh's axes, with ZeRO-1 and ZeRO-3 over the data-parallel axes) are priced with the same cost model
and memory budget; each hand layout gets its best completion by the same ILP. Prints one markdown table
per preset, then a summary of auto / best hand layout, and where auto loses, the diff against the winner.
The ``auto + grid starts`` row is the automatic solve run once more from the best of all those plans
(``plan_graph(starts=...)``): what the planner reaches when the grid's global structures are given to it.

    python benchmarks/compare_gpt.py                                  # 1.3b and 6.7b on 8x8, h100 (~15 min)
    python benchmarks/compare_gpt.py --presets 125m --meshes 2x4 --time-budget 10
    python benchmarks/compare_gpt.py --set batch=32 --json out.json

Batch: 16 sequences of 1024 tokens by default (``--set batch=...`` to change).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    from autoshard._examples import load_example
    from autoshard.planner.compare import compare, diff_plans
    from autoshard.target import Target
    from autoshard.trace import trace

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=["1.3b", "6.7b"])
    p.add_argument("--meshes", nargs="+", default=["8x8"])
    p.add_argument("--hardware", default="h100")
    p.add_argument("--time-budget", type=float, default=30.0, help="solver seconds per plan")
    p.add_argument("--memory-budget", default="auto", help="bytes per device, 'auto' or 'none'")
    p.add_argument("--set", action="append", default=[], help="preset override, e.g. batch=32 (repeatable)")
    p.add_argument("--json", help="also write the results as JSON here")
    args = p.parse_args()
    overrides = ["batch=16", *args.set]
    print(f"hardware {args.hardware}, {' '.join(overrides)}, solver budget {args.time_budget:.0f} s per plan, "
          f"memory budget {args.memory_budget}")
    results, summary = [], []
    for preset in args.presets:
        for mesh in args.meshes:
            t0 = time.perf_counter()
            target = Target.of(mesh, args.hardware, args.memory_budget)
            example = load_example(str(ROOT / "examples" / "gpt.py"), preset, overrides, abstract=True)
            c = compare(trace(example.train_step, *example.args), target.cost, hardware=target.hardware,
                        memory_budget=target.memory_budget, time_budget_s=args.time_budget,
                        log=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
            wall = time.perf_counter() - t0
            best = c.best_hand
            print(f"\n### GPT {preset} on {mesh} ({wall:.0f} s)\n")
            print("| layout | step ms | x auto | GiB/dev | fits | solver |")
            print("|---|---:|---:|---:|---|---|")
            statuses = [c.auto.solver.status] + ([c.seeded.solver.status] if c.seeded else [])
            for r, status in zip(c.rows, statuses + [q.plan.solver.status for q in c.priced],
                                 strict=True):
                mark = " (best hand)" if best is not None and r.name == best.layout.name else ""
                print(f"| {r.name}{mark} | {r.step_time * 1e3:.2f} | {r.ratio:.3f} | {r.peak_memory / 2**30:.1f} | "
                      f"{'yes' if r.feasible else 'no'} | {status} |", flush=True)
            ratio = c.auto_vs_best
            summary.append((preset, mesh, c.auto.predicted_step_time, best, ratio,
                            c.seeded.predicted_step_time if c.seeded else None, c.seeded_vs_best))
            results.append({"preset": preset, "mesh": mesh, "wall": wall} | c.to_dict())
            if best is not None and ratio is not None and ratio > 1 + 1e-9:
                print(f"\nauto loses to {best.layout.name}; what differs (auto -> hand):\n")
                print(diff_plans(c.auto, best.plan).text())
    print("\n### auto / best hand layout\n")
    print("| preset | mesh | auto ms | best hand layout | hand ms | auto / best | auto + grid starts ms | "
          "(auto + grid starts) / best |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for preset, mesh, auto, best, ratio, seeded, seeded_ratio in summary:
        s_ms = "-" if seeded is None else f"{seeded * 1e3:.2f}"
        if best is None:
            print(f"| {preset} | {mesh} | {auto * 1e3:.2f} | (none fits) | - | - | {s_ms} | - |")
        else:
            print(f"| {preset} | {mesh} | {auto * 1e3:.2f} | {best.layout.name} | {best.step_time * 1e3:.2f} | "
                  f"{ratio:.3f} | {s_ms} | {seeded_ratio:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
