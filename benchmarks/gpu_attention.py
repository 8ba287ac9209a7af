"""Attention kernels on one GPU at the per-device shapes of the GPT-1.3B seq-16384 plan (issue #46, item 3).

The long-sequence plans (``benchmarks/long_context.py``: GPT-1.3B bf16, seq 16384, batch 8 on 1x8) split the
batch over the devices, so each device runs attention on q, k, v [1, 16384, 32, 64] bf16, 24 times a step.
The planner prices those calls from ``examples/gpt.py``'s registered flops (``mha_forward``, ``mha_backward``:
on the matmul units) and, for the materialised attention, from the traced einsums, mask and softmax. This
script times each form's forward and backward programs and the planner prices them (``--predict``, here):

``pallas``
    ``examples/gpt.py``'s ``flash_attention`` (jax's Pallas ``mha`` through ``autoshard.splittable``): the
    forward call, and the backward call (``jax.vjp`` of ``_mha`` on the shard: the forward kernel again for
    its row statistics, then the backward kernels), each jitted alone, as the emitted step runs them.
``ring1``
    The ring form's blocks on one device (``gpu_ring_blocks.measure`` with ``n = 1``: ``_mha_block`` and
    ``_mha_block_backward`` on the saved log-sum-exps, no forward replay); ``ring8`` is one device's share
    of an 8-device ring at the same global sequence.
``cudnn``
    ``jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")``: the forward, and the forward and
    backward together (``jax.vjp`` then the pullback; its backward alone is the difference).
``materialised``
    ``examples/gpt.py``'s ``attention`` (fp32 scores [1, 16, 16384, 16384]: half a layer's 32 heads, whose
    scores and gradients together would pass 100 GB): the forward, and the forward and backward together,
    as the 3.5 s step (``gpu_longseq.py``'s ``sel`` row) runs them.
``softmaxL``
    The score chain alone at row length ``L``: ``softmax(x).astype(bf16)`` over the last axis of a random fp32
    [2**31 / L, L], forward, and forward with the pullback of a bf16 cotangent. The 2026-11-27 profile found
    the 16k rows' softmax fusions at 1.0-2.5 TB/s (a whole row in registers); these rows say how the
    achieved bandwidth depends on the row's length, so the price can follow it.

Every input is drawn at random (no zeros); each time is the median of ``--repeats`` synchronised calls after
one untimed call. On the GPU machine::

    JAX_PLATFORMS=cuda python benchmarks/gpu_attention.py --out rows.jsonl

here (no GPU), the planner's prices beside the rows (``h200`` preset for an H200)::

    python benchmarks/gpu_attention.py --predict rows.jsonl

A CPU smoke run (interpreted Pallas kernels, tiny shapes)::

    JAX_PLATFORMS=cpu python benchmarks/gpu_attention.py --out /tmp/att.jsonl --seq 256 --heads 2 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

FORMS = ("pallas", "cudnn", "ring1", "ring8", "materialised", "softmax1024", "softmax4096", "softmax16384",
         "softmax65536")
from gpu_ring_blocks import _median_seconds  # noqa: E402  (compiled once, then the median of repeats)

SOFTMAX_ELEMENTS = 2**31  # the softmax rows: [2**31 / L, L] fp32 (8.6 GB), the bytes of 8 heads' 16k scores


def _inputs(batch: int, seq: int, heads: int, head_dim: int) -> tuple[Any, ...]:
    import jax
    import jax.numpy as jnp

    shape = (batch, seq, heads, head_dim)
    return tuple(jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4))


def _fwd_and_grad(fn: Any) -> tuple[Any, Any]:
    """The forward alone, and the forward with the pullback of ``dout`` (the three input gradients)."""
    import jax

    def both(q: Any, k: Any, v: Any, dout: Any) -> Any:
        out, pull = jax.vjp(fn, q, k, v)
        return pull(dout.astype(out.dtype))

    return jax.jit(fn), jax.jit(both)


def measure(form: str, batch: int, seq: int, heads: int, head_dim: int, repeats: int) -> dict[str, Any]:
    import gpt  # examples/gpt.py
    import jax

    row: dict[str, Any] = {"part": "attention", "form": form, "batch": batch, "seq": seq, "heads": heads,
                           "head_dim": head_dim, "dtype": "bfloat16"}
    if form.startswith("softmax"):
        return _softmax_row(row, int(form[7:]), repeats)
    q, k, v, dout = _inputs(batch, seq, heads, head_dim)
    on_gpu = jax.default_backend() == "gpu"
    if form.startswith("ring"):
        from gpu_ring_blocks import measure as ring_measure

        n = int(form[4:])
        r = ring_measure(seq, n, batch, heads, head_dim, repeats)
        row.update(n=n, forward_s=r["forward_s"], backward_s=r["backward_s"])
        return row
    if form == "pallas":
        fwd = jax.jit(gpt.flash_attention)

        def bwd_call(q: Any, k: Any, v: Any, dout: Any) -> Any:  # the backward splittable call's body
            return jax.vjp(gpt._mha, q, k, v)[1](dout)

        row["forward_s"] = _median_seconds(fwd, (q, k, v), repeats)
        row["backward_s"] = _median_seconds(jax.jit(bwd_call), (q, k, v, dout), repeats)
        _, both = _fwd_and_grad(gpt.flash_attention)
        row["fwd_bwd_s"] = _median_seconds(both, (q, k, v, dout), repeats)
        return row
    if form == "cudnn":
        impl = "cudnn" if on_gpu else None
        row["implementation"] = impl

        def fn(q: Any, k: Any, v: Any) -> Any:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    else:  # half the heads: one layer's 32 heads of fp32 scores and their gradients need over 100 GB at once
        fn = gpt.attention
        row["heads"] = heads = max(1, heads // 2)
        q, k, v, dout = (x[:, :, :heads] for x in (q, k, v, dout))
    fwd, both = _fwd_and_grad(fn)
    row["forward_s"] = _median_seconds(fwd, (q, k, v), repeats)
    row["fwd_bwd_s"] = _median_seconds(both, (q, k, v, dout), repeats)
    row["backward_s"] = row["fwd_bwd_s"] - row["forward_s"]
    if form == "materialised":
        mem = both.lower(q, k, v, dout).compile().memory_analysis()
        row["xla_temp_bytes"] = int(mem.temp_size_in_bytes)
    return row


def _softmax(x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.nn.softmax(x, axis=-1).astype(jnp.bfloat16)


def _softmax_row(row: dict[str, Any], length: int, repeats: int) -> dict[str, Any]:
    """``softmaxL``: the forward and the forward with its pullback, and the least bytes each must move (the
    forward reads fp32 and writes bf16; the backward reads the bf16 cotangent and the saved output, writes
    the fp32 gradient)."""
    import jax
    import jax.numpy as jnp

    rows = SOFTMAX_ELEMENTS // length
    x = jax.random.normal(jax.random.key(0), (rows, length), jnp.float32)
    dy = jax.random.normal(jax.random.key(1), (rows, length), jnp.bfloat16)
    fwd = jax.jit(_softmax)

    def both(x: Any, dy: Any) -> Any:
        return jax.vjp(_softmax, x)[1](dy)[0]

    n = rows * length
    row.update(form=f"softmax{length}", rows=rows, length=length, forward_min_bytes=6 * n,
               backward_min_bytes=2 * n + 2 * n + 4 * n)
    row["forward_s"] = _median_seconds(fwd, (x,), repeats)
    row["fwd_bwd_s"] = _median_seconds(jax.jit(both), (x, dy), repeats)
    row["backward_s"] = row["fwd_bwd_s"] - row["forward_s"]
    row["forward_gb_s"] = row["forward_min_bytes"] / row["forward_s"] / 1e9
    row["backward_gb_s"] = row["backward_min_bytes"] / max(row["backward_s"], 1e-12) / 1e9
    return row


# ---- the planner's prices (here, no GPU) ------------------------------------------------------------------


def _graph(fn: Any, row: dict[str, Any]) -> Any:
    import jax
    import jax.numpy as jnp

    import autoshard

    x = jax.ShapeDtypeStruct((row["batch"], row["seq"], row["heads"], row["head_dim"]), jnp.bfloat16)

    def loss(q: Any, k: Any, v: Any, dout: Any) -> Any:
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * dout.astype(jnp.float32))

    return autoshard.trace(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, x)


def predict(row: dict[str, Any], hardware: str) -> dict[str, float]:
    """The planner's compute seconds for the row's forward and backward on a 1-device mesh: the kernel calls'
    strategy prices (``pallas``), or the whole traced forward and backward (``materialised``: every op's
    price summed by phase, as the step's plan adds them)."""
    import gpt
    from gpu_ring_blocks import predict as ring_predict

    from autoshard.strategies.registry import RuleContext, strategies_for
    from autoshard.target import cost_model_for

    if row["form"].startswith("ring"):
        import autoshard.target as target

        saved = target.cost_model_for
        target.cost_model_for = lambda hw, shape, names: saved(hardware, shape, names)  # the row's preset
        try:
            return ring_predict(row)
        finally:
            target.cost_model_for = saved
    if row["form"].startswith("softmax"):
        import jax
        import jax.numpy as jnp

        import autoshard

        x = jax.ShapeDtypeStruct((row["rows"], row["length"]), jnp.float32)
        dy = jax.ShapeDtypeStruct((row["rows"], row["length"]), jnp.bfloat16)
        graph = autoshard.trace(lambda x, dy: jax.vjp(_softmax, x)[1](dy)[0], x, dy)
        fn = _softmax
    else:
        fn = {"pallas": gpt.flash_attention, "materialised": gpt.attention}.get(row["form"])
        if fn is None:
            return {}
        graph = _graph(fn, row)
    cost = cost_model_for(hardware, (1,), ("x",))
    ctx = RuleContext.of(graph, cost.mesh)
    got: dict[str, float] = {}
    for op in graph.ops:
        strategies = strategies_for(op, ctx, cost)
        if not strategies:
            continue
        best = min(s.compute_time for s in strategies)
        phase = "forward" if op.phase == "forward" else "backward"
        if row["form"] == "pallas" and op.primitive != "custom_partitioning":
            continue
        got[f"predicted_{phase}_s"] = got.get(f"predicted_{phase}_s", 0.0) + best
    if row["form"] == "materialised" or row["form"].startswith("softmax"):  # the plan's own price of the forward and backward (fusion as it counts it)
        import autoshard

        plan = autoshard.plan(graph, mesh=(1,), hardware=hardware, time_budget_s=30, memory_budget=1e15,
                              recompute="none")
        got["predicted_plan_s"] = plan.predicted_step_time
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--predict", type=Path, help="rows measured on the GPU: print them beside the planner's")
    ap.add_argument("--hardware", default=None, help="--predict's preset (default: from the rows' device)")
    ap.add_argument("--forms", nargs="*", default=list(FORMS), choices=FORMS)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds from the start")
    args = ap.parse_args(argv)
    if args.predict:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        rows = [json.loads(x) for x in args.predict.read_text().splitlines() if x.strip()]
        env = next((r for r in rows if r.get("part") == "env"), {})
        hardware = args.hardware or ("h200" if "H200" in env.get("device", "") else "h100")
        for r in rows:
            if r.get("part") != "attention" or "error" in r:
                continue
            p = predict(r, hardware)
            for phase in ("forward", "backward"):
                if f"predicted_{phase}_s" in p and r.get(f"{phase}_s"):
                    p[f"{phase}_ratio"] = p[f"predicted_{phase}_s"] / r[f"{phase}_s"]
            print(json.dumps({**r, **p, "hardware": hardware}), flush=True)
        return 0
    if args.out is None:
        ap.error("--out or --predict")
    import jax

    deadline = time.perf_counter() + args.deadline
    dev = jax.devices()[0]
    env = {"part": "env", "date": time.strftime("%Y-%m-%d"), "device": dev.device_kind, "platform": dev.platform,
           "jax": jax.__version__}
    with args.out.open("a") as f:
        f.write(json.dumps(env) + "\n")
    for form in args.forms:
        if time.perf_counter() + 20 > deadline:
            print(f"deadline: {form} and later skipped", flush=True)
            break
        t0 = time.perf_counter()
        try:
            row = measure(form, args.batch, args.seq, args.heads, args.head_dim, args.repeats)
        except Exception as e:  # an out-of-memory or a kernel that does not compile is a row too
            row = {"part": "attention", "form": form, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        row["wall_s"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
        with args.out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        jax.clear_caches()
    return 0


if __name__ == "__main__":
    sys.exit(main())
