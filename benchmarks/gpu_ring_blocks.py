"""One device's share of a zig-zag ring of flash blocks, timed on one GPU, against the planner's price.

A ring needs several devices; its compute does not. ``jax.vmap`` with an axis name runs the ``n`` devices'
programs of ``autoshard.ring`` (``ring_forward`` / ``ring_backward``, the code the emitted step runs) side by
side on one GPU: ``ppermute`` becomes a reshuffle in memory, each block a batched Pallas call. A device's
share is the measured time over ``n`` (every device does the same work: the zig-zag's point). The rows
check the planner's ``work_share`` and the flash blocks' prices (``strategies.custom._ring``, compute only:
the ring's sends are not in this program).

On the GPU machine (no planner needed)::

    JAX_PLATFORMS=cuda python benchmarks/gpu_ring_blocks.py --out rows.jsonl

here, the planner's compute for the same rows (``h100`` preset)::

    python benchmarks/gpu_ring_blocks.py --predict rows.jsonl

A CPU smoke run (interpreted kernels): ``python benchmarks/gpu_ring_blocks.py --out /tmp/x.jsonl --seq 256
--n 1 2 --heads 2 --repeats 1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))


def _ring_fns(n: int) -> tuple[Any, Any]:
    """The forward and backward of ``n`` devices' ring programs on one device (``vmap`` over axis ``i``)."""
    import gpt  # examples/gpt.py: the flash blocks
    import jax

    from autoshard import ring

    def fwd(q: Any, k: Any, v: Any) -> Any:
        return ring.ring_forward(gpt._mha_block, "i", n, q, k, v)

    def bwd(q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any) -> Any:
        return ring.ring_backward(gpt._mha_block_backward, "i", n, q, k, v, out, lse, dout)

    return jax.jit(jax.vmap(fwd, axis_name="i")), jax.jit(jax.vmap(bwd, axis_name="i"))


def _median_seconds(fn: Any, args: tuple[Any, ...], repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(seq: int, n: int, batch: int, heads: int, head_dim: int, repeats: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    shard = (n, batch, seq // n, heads, head_dim)  # each device's contiguous shard, stacked
    q, k, v, dout = (jax.random.normal(jax.random.key(i), shard, jnp.bfloat16) for i in range(4))
    fwd, bwd = _ring_fns(n)
    out, lse = fwd(q, k, v)
    row = {"part": "ring_blocks", "device": jax.devices()[0].device_kind, "jax": jax.__version__, "seq": seq,
           "n": n, "batch": batch, "heads": heads, "head_dim": head_dim,
           "forward_s": _median_seconds(fwd, (q, k, v), repeats) / n,
           "backward_s": _median_seconds(bwd, (q, k, v, out, lse, dout), repeats) / n}
    return row


def predict(row: dict[str, Any]) -> dict[str, float]:
    """The planner's compute seconds for one device's forward and backward ring calls on ``n`` devices."""
    import gpt
    import jax
    import jax.numpy as jnp

    import autoshard
    from autoshard.strategies.registry import RuleContext, strategies_for
    from autoshard.target import cost_model_for

    n = row["n"]
    attend = autoshard.ring_attention(gpt._mha_block, gpt._mha_block_backward)
    x = jax.ShapeDtypeStruct((row["batch"], row["seq"], row["heads"], row["head_dim"]), jnp.bfloat16)
    graph = autoshard.trace(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)),
                                     argnums=(0, 1, 2)), x, x, x)
    cost = cost_model_for("h100", (n,), ("x",))
    ctx = RuleContext.of(graph, cost.mesh)
    want = "R·S(x)·R·R" if n > 1 else "R·R·R·R"
    got = {}
    for op in graph.ops:
        if op.primitive == "custom_partitioning":
            (st,) = [s for s in strategies_for(op, ctx, cost) if str(s.out_specs[0]) == want]
            got[f"predicted_{op.phase}_s"] = st.compute_time
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--predict", type=Path, help="rows measured on the GPU: print them beside the planner's")
    ap.add_argument("--seq", type=int, nargs="*", default=[16384, 65536])
    ap.add_argument("--n", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    if args.predict:
        for line in args.predict.read_text().splitlines():
            row = json.loads(line)
            p = predict(row)
            print(json.dumps({**row, **p, "forward_ratio": p["predicted_forward_s"] / row["forward_s"],
                              "backward_ratio": p["predicted_backward_s"] / row["backward_s"]}))
        return
    if args.out is None:
        ap.error("--out or --predict")
    for seq in args.seq:
        for n in args.n:
            try:
                row = measure(seq, n, args.batch, args.heads, args.head_dim, args.repeats)
            except Exception as e:  # an out-of-memory row is a row
                row = {"part": "ring_blocks", "seq": seq, "n": n, "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
