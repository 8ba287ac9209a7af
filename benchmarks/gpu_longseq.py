"""Ground truth for issue #34's long sequence: one GPU running one GPT-1.3B sequence of 16384 tokens.

The 1x8 plan of issue #34 (GPT-1.3B, seq_len 16384, batch 8, bf16) splits the batch over the 8 devices, so
each device runs one sequence. This script measures that per-device step on ONE GPU (batch 1), several ways:

``sel``, ``full``
    The step as traced, every block rewritten by autoshard's recompute (``selective`` or ``full``) and
    re-emitted for the one device (train state donated), as ``gpu_truth.py``'s ``recompute`` part does.
``cudnn``
    The example's model with its attention replaced (in this script; ``examples/gpt.py`` is unchanged) by
    ``jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")`` (flash attention),
    ``jax.jit`` of ``train_step`` with the state donated; ``cudnn-remat`` is the same with ``remat=True``
    (every block under ``nn.remat``).
``flash``
    The example with ``flash=True`` (jax's Pallas flash-attention kernels through ``autoshard.splittable``),
    ``jax.jit`` of ``train_step`` with the state donated: the row the planner's long-sequence plan rests on.
``none``
    The example's ``train_step`` as written, jitted, state donated (its attention probabilities for 24 layers
    do not fit one GPU: the row records XLA's memory analysis and the error).

Each row: XLA's ``memory_analysis()`` (temp, argument, output, alias bytes), the median of ``--repeats``
synchronised steps after 2 untimed, the device's peak bytes in use. A row is written as soon as it is measured;
an error (out of memory) is a row too. On the GPU machine::

    JAX_PLATFORMS=cuda python benchmarks/gpu_longseq.py --out rows.jsonl --deadline 400

and here (no GPU), the planner's predictions for the ``sel``, ``full``, ``flash`` and ``none`` rows on a 1-device mesh
(the preset matching the device: ``h200`` for an H200, ``h100`` for an H100)::

    python benchmarks/gpu_longseq.py --predict rows.jsonl

A CPU smoke test: ``JAX_PLATFORMS=cpu python benchmarks/gpu_longseq.py --out /tmp/x.jsonl --preset tiny
--seq 256 --batch 1`` (the cudnn rows use XLA's attention there: ``implementation=None``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_truth import _emit_row, time_steps, xla_memory  # noqa: E402

# the rows, most important first
ROWS = ("sel", "cudnn", "flash", "full", "cudnn-remat", "none")
DEADLINE = float("inf")


def overrides(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> list[str]:
    return [f"dtype={args.dtype}", f"batch={args.batch}", f"seq_len={args.seq}", *extra]


def cudnn_module(implementation: str | None) -> Any:
    """``examples/gpt.py`` loaded as a module whose ``attention`` is ``jax.nn.dot_product_attention`` (causal)
    on the same q, k, v (layout [batch, seq, heads, head_dim])."""
    import jax

    from autoshard._examples import load_module

    gpt = load_module(ROOT / "examples" / "gpt.py")

    def flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)

    gpt.attention = flash  # Attention looks the name up in the module when it is called
    return gpt


def measure(name: str, args: argparse.Namespace, out: Path, on_gpu: bool) -> None:
    import jax

    from autoshard._examples import load_example

    t0 = time.perf_counter()
    row: dict[str, Any] = {"part": "longseq", "row": name, "model": "gpt", "preset": args.preset,
                           "overrides": overrides(args, {"cudnn-remat": ("remat=true",),
                                                         "flash": ("flash=true",)}.get(name, ())),
                           "mode": {"sel": "selective", "full": "full"}.get(name, "none"),
                           "rewrite": os.environ.get("AUTOSHARD_COMMIT", "")}
    holder: dict[str, Any] = {}
    try:
        if name in ("sel", "full"):
            from autoshard.emit import emit
            from autoshard.trace import trace
            from autoshard.trace.remat import blocks, rematerialize

            ex = load_example(ROOT / "examples" / "gpt.py", args.preset, row["overrides"], abstract=False)
            graph = trace(ex.train_step, *ex.args)
            graph = rematerialize(graph, {b: row["mode"] for b in blocks(graph)})
            mesh = jax.sharding.Mesh(jax.devices()[:1], ("x",))
            step = emit(graph, {}, mesh)
            holder["args"] = step.place(*ex.args)
            del ex
            fn: Any = step
            row.update(xla_memory(step.compiled(*holder["args"])))
        else:
            if name in ("none", "flash"):
                from autoshard._examples import load_module

                module = load_module(ROOT / "examples" / "gpt.py")
            else:
                module = cudnn_module("cudnn" if on_gpu else None)
                row["attention"] = "jax.nn.dot_product_attention(is_causal=True, implementation=%r)" % (
                    "cudnn" if on_gpu else None)
            kw = {"dtype": args.dtype, "batch": args.batch, "seq_len": args.seq}
            if name == "cudnn-remat":
                kw["remat"] = True
            if name == "flash":
                kw["flash"] = True
            holder["args"] = module.make(args.preset, **kw)
            fn = jax.jit(module.train_step, donate_argnums=0).lower(*holder["args"]).compile()
            row.update(xla_memory(fn))
        row["compile_wall_s"] = time.perf_counter() - t0
        _emit_row(out, {**row, "stage": "compiled"})  # the memory analysis survives a failed run
        row["median_s"], row["min_s"] = time_steps(fn, holder.pop("args"), args.repeats)
        row["device_peak_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    except Exception as e:  # an out-of-memory is a measurement too
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
    row["case_wall_s"] = time.perf_counter() - t0
    _emit_row(out, row)
    holder.clear()
    fn = None
    gc.collect()
    jax.clear_caches()


def predict(rows_path: Path, hardware: str | None) -> None:
    """The planner's predictions (1-device mesh) beside each measured row it can plan (the example's step as
    written, with recompute none, selective or full)."""
    import autoshard
    from autoshard._examples import load_example

    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    env = next(r for r in rows if r["part"] == "env")
    if hardware is None:
        hardware = "h200" if "H200" in env["device"] else "h100"
    print(f"device {env['device']}, jax {env['jax']}; planner preset {hardware!r}, 1-device mesh")
    print(f"{'row':<12} {'XLA GB':>8} {'pred GB':>8} {'ratio':>6}   {'meas ms':>8} {'pred ms':>8} {'ratio':>6}")
    for r in rows:
        if r["part"] != "longseq" or "stage" in r:
            continue
        meas = r.get("median_s")
        xm = r.get("xla_peak_bytes")
        cells = f"{xm / 1e9:8.2f}" if xm else f"{'-':>8}"
        if r["row"] in ("sel", "full", "none", "flash"):
            ex = load_example(ROOT / "examples" / "gpt.py", r["preset"], r["overrides"], abstract=True)
            plan = autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware=hardware, time_budget_s=60,
                                  memory_budget=1e15, recompute=r["mode"])
            pm, ps = plan.peak_memory, plan.predicted_step_time
            cells += f" {pm / 1e9:8.2f} {pm / xm:6.2f}" if xm else f" {pm / 1e9:8.2f} {'-':>6}"
            cells += f"   {meas * 1e3:8.1f} {ps * 1e3:8.1f} {ps / meas:6.2f}" if meas else \
                f"   {'-':>8} {ps * 1e3:8.1f} {'-':>6}"
        else:
            cells += f" {'-':>8} {'-':>6}   " + (f"{meas * 1e3:8.1f}" if meas else f"{'-':>8}")
        err = f"  ({r['error'][:60]})" if "error" in r else ""
        print(f"{r['row']:<12} {cells}{err}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="append measured rows (JSON lines) to this file")
    ap.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    ap.add_argument("--preset", default="1.3b")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--deadline", type=float, default=float("inf"),
                    help="seconds from the start after which no further row is started")
    ap.add_argument("--row-seconds", type=float, default=45.0,
                    help="a row is not started with less than this left before the deadline")
    ap.add_argument("--predict", type=Path, help="print the planner's predictions for these measured rows")
    ap.add_argument("--hardware", default=None, help="--predict's preset (default: from the rows' device)")
    args = ap.parse_args(argv)
    if args.predict:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        predict(args.predict, args.hardware)
        return 0
    deadline = time.perf_counter() + args.deadline
    import jax

    assert args.out is not None, "--out is required when measuring"
    dev = jax.devices()[0]
    _emit_row(args.out, {"part": "env", "date": time.strftime("%Y-%m-%d"), "device": dev.device_kind,
                         "platform": dev.platform, "jax": jax.__version__, "argv": sys.argv[1:],
                         "autoshard": str(Path(__import__("autoshard").__file__).parent)})
    for name in args.rows:
        if time.perf_counter() + args.row_seconds > deadline:
            print(f"deadline: {name} and later rows skipped", flush=True)
            break
        measure(name, args, args.out, dev.platform == "gpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
