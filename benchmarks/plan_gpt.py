"""Planning time and predicted step time of `autoshard plan` on the GPT presets (issue #4's benchmark).

Each case runs the real CLI in a fresh process (so import and trace time count, and one case's memory
does not leak into the next) and reads the plan JSON it writes. Prints a markdown table:

    python benchmarks/plan_gpt.py                                   # the full grid (~30 minutes)
    python benchmarks/plan_gpt.py --presets 39b --meshes 8x8         # one case
    python benchmarks/plan_gpt.py --set scan_layers=true             # scanned layer stacks
    python benchmarks/plan_gpt.py --meshes 8x8 --microbatches 8 --batch 64 --hardware v100
                                     # pipelined and pure intra-op plans, the faster wins (issue #5)

Batch: ``--batch`` sequences of 1024 tokens (default 16: Alpa's 1024 needs pipelining and remat for the
big presets, which pure intra-op plans do not use; at 16 every preset fits an 8x8 H100 mesh).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ["125m", "350m", "760m", "1.3b", "2.6b", "6.7b", "15b", "39b"]
MESHES = ["8", "2x4", "8x8", "16x16"]


def run_case(preset: str, mesh: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "autoshard.cli", "plan", str(ROOT / "examples" / "gpt.py"),
               "--preset", preset, "--mesh", mesh, "--hardware", args.hardware,
               "--time-budget", str(args.time_budget), "--set", f"batch={args.batch}", "-o", str(out)]
        for s in args.set:
            cmd += ["--set", s]
        if args.microbatches:
            cmd += ["--microbatches", str(args.microbatches)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr or proc.stdout).strip().splitlines()
            return {"preset": preset, "mesh": mesh, "wall": wall, "error": last[-1] if last else "failed"}
        plan = json.loads(out.read_text())
    s = plan["solver"]
    if plan.get("kind") == "pipeline":
        intra = s.get("intra_op_step_time")
        return {
            "preset": preset, "mesh": mesh, "wall": wall, "kind": "pipeline", "stages": len(plan["stages"]),
            "submeshes": " ".join(f"{a}x{b}" for a, b in (st["submesh"] for st in plan["stages"])),
            "step_ms": plan["predicted_step_time"] * 1e3, "peak_gib": plan["peak_memory"] / 2**30,
            "intra_ms": intra * 1e3 if isinstance(intra, float) else None, "pipe_ms": plan["predicted_step_time"] * 1e3,
            "bubble": plan["bubble_fraction"], "layers": plan["num_layers"],
            "distinct": s.get("distinct_layers"),
        }
    return {
        "preset": preset, "mesh": mesh, "wall": wall,
        "trace": s.get("trace_seconds", float("nan")), "build": s["build_seconds"], "solve": s["solve_seconds"],
        "nodes": s["nodes"], "status": s["status"], "optimal": s["optimal"],
        "gap": (s["objective"] - s["lower_bound"]) / s["objective"] if s.get("lower_bound") else None,
        "step_ms": plan["predicted_step_time"] * 1e3, "peak_gib": plan["peak_memory"] / 2**30,
        "kind": "intra-op", "intra_ms": plan["predicted_step_time"] * 1e3,
        "pipe_ms": s["pipeline_step_time"] * 1e3 if s.get("pipeline_step_time") else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--meshes", nargs="+", default=MESHES)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--time-budget", type=float, default=30.0)
    p.add_argument("--set", action="append", default=[], help="extra preset override, e.g. scan_layers=true")
    p.add_argument("--microbatches", type=int, help="also plan pipelines with this many microbatches")
    p.add_argument("--json", help="also write the rows as JSON here")
    args = p.parse_args()
    print(f"hardware {args.hardware}, batch {args.batch} x 1024 tokens, solver budget {args.time_budget:.0f} s"
          + (f", {' '.join(args.set)}" if args.set else ""))
    rows = []
    if args.microbatches:
        print(f"{args.microbatches} microbatches: the faster of the best pipelined and the best intra-op plan")
        print("| preset | mesh | plan wall s | chosen | stages | bubble | pipelined ms | intra-op ms | GiB/dev |")
        print("|---|---|---:|---|---|---:|---:|---:|---:|")
    else:
        print("| preset | mesh | plan wall s | trace | build | solve | nodes | solver | gap | step ms | GiB/dev |")
        print("|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for preset in args.presets:
        for mesh in args.meshes:
            r = run_case(preset, mesh, args)
            rows.append(r)
            if "error" in r:
                print(f"| {preset} | {mesh} | {r['wall']:.1f} | error: {r['error']} |", flush=True)
                continue
            if args.microbatches:
                ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
                stages = f"{r['stages']}: {r['submeshes']}" if r["kind"] == "pipeline" else "-"
                bubble = f"{100 * r['bubble']:.0f}%" if r["kind"] == "pipeline" else "-"
                print(f"| {preset} | {mesh} | {r['wall']:.1f} | {r['kind']} | {stages} | {bubble} | "
                      f"{ms(r['pipe_ms'])} | {ms(r['intra_ms'])} | {r['peak_gib']:.1f} |", flush=True)
                continue
            gap = "" if r["gap"] is None else f"{100 * r['gap']:.1f}%"
            print(f"| {preset} | {mesh} | {r['wall']:.1f} | {r['trace']:.1f} | {r['build']:.1f} | "
                  f"{r['solve']:.1f} | {r['nodes']} | {'optimal' if r['optimal'] else r['status']} | {gap} | "
                  f"{r['step_ms']:.1f} | {r['peak_gib']:.1f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
