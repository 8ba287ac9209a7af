"""Recompute applied to a traced GPT step: ``trace.remat.rematerialize`` (a rewrite of the Graph) beside the
step traced again through JAX with the replays bound in place (how ``trace.remat`` worked before; kept
as the reference in ``tests/test_remat.py``), timed alternately in one process (CPU and wall seconds, so
a loaded machine shows in the wall column only), and the two results compared:

    python benchmarks/remat_rewrite.py --preset 39b --mode full
    python benchmarks/remat_rewrite.py --preset 1t --mode selective --set batch=6
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's autoshard, not an installed one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="39b")
    ap.add_argument("--mode", default="full", choices=["selective", "full"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a preset override (int)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    from autoshard._examples import load_module
    from autoshard.pipeline.pipeline_plan import graph_digest
    from autoshard.trace import trace
    from autoshard.trace.buffers import buffers
    from autoshard.trace.remat import rematerialize, uniform

    spec = importlib.util.spec_from_file_location("test_remat", ROOT / "tests" / "test_remat.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)  # type: ignore[union-attr]

    mod = load_module(ROOT / "examples" / "gpt.py")
    sets = {k: int(v) for k, v in (s.split("=", 1) for s in args.set)}
    t0 = time.perf_counter()
    graph = trace(mod.train_step, *mod.make(args.preset, abstract=True, **sets))
    print(f"{args.preset} {sets or ''}: traced {len(graph.ops)} ops in {time.perf_counter() - t0:.1f} s")
    config = uniform(graph, args.mode)
    times: dict[str, list[tuple[float, float]]] = {"retrace": [], "rewrite": []}
    made = {}
    for _ in range(args.rounds):
        for name, fn in (("retrace", reference._retraced), ("rewrite", rematerialize)):
            c, w = time.process_time(), time.perf_counter()
            made[name] = fn(graph, config)
            times[name].append((time.process_time() - c, time.perf_counter() - w))
    for name, ts in times.items():
        print(f"{name:8s} " + "  ".join(f"cpu {c:6.1f} s wall {w:6.1f} s" for c, w in ts))
    a, b = made["retrace"], made["rewrite"]
    print(f"{args.mode}: {len(b.ops)} ops (retrace {len(a.ops)}); same digest {graph_digest(a) == graph_digest(b)}; "
          f"same flops by phase {a.flops_by_phase() == b.flops_by_phase()}; peak {buffers(b).peak(b) / 1e9:.2f} GB "
          f"(retrace {buffers(a).peak(a) / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()
