"""Long sequences through fused attention: context parallelism (``autoshard.ring_attention``) against the
kernel split over batch and heads only (``splittable``: data parallel, or DeepSpeed-Ulysses' all-to-alls).

Each case plans GPT (``examples/gpt.py``, bf16) with ``flash=true`` (Pallas flash kernels, split over batch
and heads) or ``flash=true ring=true`` (the same kernels as the blocks of a zig-zag ring, which the planner
may also split along the sequence), and prints the predicted step, MFU, peak memory per device, where the
attention calls are split, and the planning time. Planner predictions only (no device)::

    python benchmarks/long_context.py                       # every case (~10 minutes on 2 cores)
    python benchmarks/long_context.py --cases 128k-1x8      # one
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
from autoshard.planner.plan import PlanError  # noqa: E402

# name -> (preset, mesh, overrides)
CASES = {
    "16k-b8-1x8": ("1.3b", (1, 8), ["seq_len=16384", "batch=8"]),
    "128k-b1-1x8": ("1.3b", (1, 8), ["seq_len=131072", "batch=1"]),
    "128k-b1-8x8": ("1.3b", (8, 8), ["seq_len=131072", "batch=1"]),
    "512k-b1-8x8": ("1.3b", (8, 8), ["seq_len=524288", "batch=1"]),
}
KINDS = {"flash": ["flash=true"], "flash+ring": ["flash=true", "ring=true"]}


def attention_layout(graph: autoshard.Graph, plan: autoshard.Plan) -> str:
    """The layouts of the attention calls' first results ([b, s, h, d]), counted."""
    seen: dict[str, int] = {}
    for op in graph.ops:
        if op.primitive == "custom_partitioning" and op.phase == "forward":
            s = str(plan.specs[()][op.outputs[0]])
            seen[s] = seen.get(s, 0) + 1
    return ", ".join(f"{s} x{n}" for s, n in seen.items()) or "-"


def run(name: str, kind: str, budget: float) -> str:
    preset, mesh, extra = CASES[name]
    ex = load_example(ROOT / "examples" / "gpt.py", preset, ["dtype=bfloat16", *extra, *KINDS[kind]],
                      abstract=True)
    t0 = time.perf_counter()
    try:
        graph = autoshard.trace(ex.train_step, *ex.args)
        plan = autoshard.plan(graph, mesh=mesh, hardware="h100", time_budget_s=budget)
    except PlanError as e:
        return f"| {name} | {kind} | does not fit: {str(e).splitlines()[0][:120]} | | | | {time.perf_counter() - t0:.1f} s |"
    wall = time.perf_counter() - t0
    mfu = plan.mfu
    recompute = sorted(set(plan.recompute.values())) or ["none"]
    return (f"| {name} | {kind} | {plan.predicted_step_time * 1e3:.1f} ms | {100 * mfu:.1f}% | "
            f"{plan.peak_memory / 2**30:.1f} GiB ({'/'.join(recompute)}) | {attention_layout(graph, plan)} | "
            f"{wall:.1f} s |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=list(KINDS))
    ap.add_argument("--time-budget", type=float, default=60.0)
    args = ap.parse_args()
    print("| case | attention | step | MFU | peak (recompute) | attention calls [b, s, h, d] | planned in |")
    print("|---|---|---|---|---|---|---|")
    for name in args.cases:
        for kind in args.kinds:
            print(run(name, kind, args.time_budget), flush=True)


if __name__ == "__main__":
    main()
