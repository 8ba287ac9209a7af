"""One model's intra-operator plan (no pipeline) at a fixed recompute mode and a given time budget: the
step time and peak the solver reaches with time to search, so that two versions of the planner can be
compared without the default budget's seed portfolio deciding (run each version in turn, idle):

    python benchmarks/intra_op_budget.py --preset 39b --mesh 8x8 --recompute full --budget 240

Prints one line: predicted step seconds, peak GiB per device, and the call's wall seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autoshard, not an installed one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="39b")
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--hardware", default="h100")
    ap.add_argument("--recompute", default="full", choices=["none", "selective", "full"])
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the whole call")
    args = ap.parse_args()

    import autoshard
    from autoshard._examples import load_module

    mod = load_module(ROOT / "examples" / "gpt.py")
    t0 = time.perf_counter()
    plan = autoshard.plan(mod.train_step, *mod.make(args.preset, abstract=True), mesh=args.mesh,
                          hardware=args.hardware, pipeline=False, recompute=args.recompute,
                          time_budget_s=args.budget)
    print(f"{args.preset} on {args.mesh} {args.hardware}, recompute {args.recompute}, budget {args.budget:.0f} s: "
          f"{plan.predicted_step_time:.4f} s, {plan.peak_memory / 2**30:.1f} GiB, planned in "
          f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
