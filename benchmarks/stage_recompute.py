"""Recompute chosen per pipeline stage against one mode for every block.

Under 1F1B stage ``s`` of ``S`` holds ``S - s`` microbatches in flight: the first stages must recompute to
fit and the last ones need not. With ``recompute="auto"`` the stage DP picks each stage's mode beside its
submesh and its layers (``pipeline.stages``' recompute per stage); a fixed mode recomputes every block.
Each case plans GPT (``examples/gpt.py``) as an MPMD pipeline on one host of H100s and prints the predicted
step, MFU, peak memory, each stage's recompute and layers, and the planning time. Planner predictions only
(no device)::

    python benchmarks/stage_recompute.py                    # every case (~3 minutes on 2 cores)
    python benchmarks/stage_recompute.py --cases 15b-8x1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
from autoshard._examples import load_example  # noqa: E402
from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.pipeline import PipelinePlan  # noqa: E402

# name -> (preset, overrides, microbatches, stage shape): one host of 8 H100s
CASES = {
    "15b-8x1": ("15b", ["batch=256"], 32, (1, 1)),  # 8 stages of one GPU: 8..1 microbatches in flight
    "6.7b-4x2": ("6.7b", ["batch=512"], 64, (1, 2)),  # 4 stages of two GPUs
}
MODES = ("auto", "selective", "full")


def run(name: str, mode: str, budget: float) -> str:
    preset, extra, count, shape = CASES[name]
    ex = load_example(ROOT / "examples" / "gpt.py", preset, extra, abstract=True)
    t0 = time.perf_counter()
    try:
        plan = autoshard.plan(ex.train_step, *ex.args, mesh=(1, 8), hardware="h100", microbatches=count,
                              pipeline=True, stage_shape=shape, recompute=mode, time_budget_s=budget)
    except AutoshardError as e:
        return f"| {name} | {mode} | does not fit: {str(e).splitlines()[0][:100]} | | | | {time.perf_counter() - t0:.1f} s |"
    wall = time.perf_counter() - t0
    assert isinstance(plan, PipelinePlan)
    every = "/".join(sorted(set(plan.recompute.values()))) or "none"  # one mode on every block
    stages = "; ".join(f"{st.layers[1] - st.layers[0] + 1} {st.recompute or every}" for st in plan.stages)
    return (f"| {name} | {mode} | {plan.predicted_step_time:.3f} s | {100 * (plan.mfu or 0):.1f}% | "
            f"{plan.peak_memory / 2**30:.1f} GiB | {stages} | {wall:.1f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=list(MODES))
    ap.add_argument("--budget", type=float, default=180.0, help="time budget of each plan, seconds")
    args = ap.parse_args()
    print("| case | recompute | step | MFU | peak | stages: layers and recompute | planned in |")
    print("|---|---|---|---|---|---|---|")
    for name in args.cases:
        for mode in args.modes:
            print(run(name, mode, args.budget), flush=True)


if __name__ == "__main__":
    main()
