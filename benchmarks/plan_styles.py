"""The example GPT written in six styles (``tests/style_models.py``: the example's ``block_0``, a list of
modules ``h/0``, flax's default ``Block_0``, an nnx list, ``nn.scan``, unnumbered ``first``/``second``)
planned alike: the plan must not depend on what the blocks are called (issue #48's styles acceptance:
the same recompute choice and a predicted step time within 1% of the example's).

    python benchmarks/plan_styles.py                                   # tiny on 2x4 (seconds)
    nice -n 10 python benchmarks/plan_styles.py --preset 1.3b --mesh 8x8 --hardware h100
    python benchmarks/plan_styles.py --keep-scans        # and the nn.scan style kept a scan (unroll_scans=False)

Plans only (abstract shapes, nothing allocated); each style is planned in this one process, one after the
other, with the same options and the plan cache off. Prints one row per style: predicted step time, its ratio to the example's,
the recompute choices (block count per choice), the predicted MFU and the planning wall time.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("AUTOSHARD_CACHE_DIR", "off")  # every style planned here and now, none read back


def plan_style(name: str, preset: str, mesh: str, hardware: str, time_budget: float | None,
               overrides: dict[str, Any], unroll_scans: bool = True) -> dict[str, Any]:
    import style_models

    import autoshard

    style = style_models.STYLES[name]
    state, batch = style.make(preset, abstract=True, **overrides)
    t0 = time.perf_counter()
    plan = autoshard.plan(style.train_step, state, batch, mesh=mesh, hardware=hardware,
                          time_budget_s=time_budget, unroll_scans=unroll_scans)
    label = name if unroll_scans or name != "scan" else "scan (kept a scan)"
    return {"style": label, "step_s": plan.predicted_step_time, "wall_s": time.perf_counter() - t0,
            "recompute": dict(sorted(collections.Counter(plan.recompute.values()).items())),
            "mfu": plan.mfu if isinstance(plan.mfu, float) else plan.mfu() if callable(plan.mfu) else None, "kind": type(plan).__name__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--mesh", default="2x4")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--time-budget", type=float, default=None)
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE override of the preset")
    parser.add_argument("--styles", default=None, help="comma-separated subset (default: all six)")
    parser.add_argument("--keep-scans", action="store_true",
                        help="also plan the nn.scan style kept a scan (unroll_scans=False), as it was priced before "
                             "the planner unrolled it")
    args = parser.parse_args()
    import style_models

    overrides: dict[str, Any] = {}
    for kv in args.set:
        k, v = kv.split("=", 1)
        overrides[k] = int(v) if v.isdigit() else v
    names = args.styles.split(",") if args.styles else list(style_models.STYLES)
    rows = [plan_style(n, args.preset, args.mesh, args.hardware, args.time_budget, overrides) for n in names]
    if args.keep_scans and "scan" in names:
        rows.append(plan_style("scan", args.preset, args.mesh, args.hardware, args.time_budget, overrides, False))
    ref = next((r for r in rows if r["style"] == "example"), rows[0])
    print(f"| style ({args.preset}, {args.mesh} {args.hardware}) | plan | step (ms) | vs example | recompute "
          "| MFU | planning (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "-"
        print(f"| {r['style']} | {r['kind']} | {1e3 * r['step_s']:.3f} | {r['step_s'] / ref['step_s']:.4f} | "
              f"{r['recompute'] or 'none'} | {mfu} | {r['wall_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
