"""Cost-model fidelity: predict and measure ten hand-sharded versions of one MLP train step.

The step is a 2-layer MLP, forward and backward (``loss = mean((relu(x @ W1) @ W2 - y)^2)``, gradients of
W1 and W2), on the 8 simulated CPU devices. Each layout fixes the mesh, the input and parameter shardings and
the shardings of the two activations (``with_sharding_constraint``). Its predicted time is written here by
hand from ``cost_models`` formulas: the per-device matmuls (``matmul_time``), the elementwise traffic
(``memory_time``), the collectives the layout implies (``collective_time``) and one program dispatch (the
profile's ``overhead``), summed with no overlap. The planner does not exist yet; this checks the prices.

Run::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/cost_model_fidelity.py \
        [--profile cost_models/profiles/cpu-8dev-....json | --quick-profile] [--repeats 7]

It prints each layout's predicted and measured milliseconds, the collectives XLA compiled, the Spearman rank
correlation and the median relative error. A benchmark, not a test.

Planner mode (``--planner``): the whole planner against XLA on one device, for the cases of
``tests/data/h100_fidelity.json`` (an example model at a preset, dtype, batch and remat setting). Each case is
planned on a 1-device mesh with ``--hardware`` (default ``h100``) and printed beside the recorded XLA peak memory
(temp + arguments + outputs - aliased) and step time; with ``--measure`` the step is also jitted (train state
donated) on the local device, its ``memory_analysis()`` read and its time measured, and every row is appended
as one JSON line to ``--out``. On a GPU machine::

    JAX_PLATFORMS=cuda python benchmarks/cost_model_fidelity.py --planner --measure --out fidelity.jsonl
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from cost_models import CostModel, Profile, load_profile
from cost_models.profile import shipped_profiles

B, D, H = 512, 512, 1024  # batch, model width, hidden width (float32)
F32 = 4


@dataclass
class Work:
    """What one device does in a layout: matmuls (m, n, k), elementwise bytes, collectives."""

    matmuls: list[tuple[int, int, int]] = field(default_factory=list)
    elementwise_bytes: float = 0.0
    collectives: list[tuple[str, float, tuple[str, ...]]] = field(default_factory=list)


def _mlp_work(b: int, h: int, d_in: int, d_out: int) -> Work:
    """Matmuls of the step with local batch ``b``, local hidden ``h``, contraction width ``d_in`` of the
    first layer and local output width ``d_out`` of the second; elementwise traffic of relu, its mask, the
    residual and the loss (about 5 passes over [b, h] and 6 over [b, d_out])."""
    return Work(
        matmuls=[(b, h, d_in), (b, d_out, h), (h, d_out, b), (b, h, d_out), (d_in, h, b)],
        elementwise_bytes=F32 * (5 * b * h + 6 * b * d_out),
    )


def megatron(dp: int, mp: int, dp_axes: tuple[str, ...], mp_axes: tuple[str, ...], replicas: int = 1) -> Work:
    """Batch split ``dp`` ways, W1 column- and W2 row-split ``mp`` ways (Megatron), compute replicated
    ``replicas`` ways. Forward all-reduce of the [b, D] output over mp; gradient all-reduces over dp."""
    w = _mlp_work(B // dp, H // mp, D, D)
    if mp > 1:
        w.collectives.append(("all_reduce", F32 * (B // dp) * D, mp_axes))
    if dp > 1:
        w.collectives += [("all_reduce", F32 * D * H // mp, dp_axes)] * 2
        w.collectives.append(("all_reduce", F32, dp_axes))  # the loss
    return w


def fsdp(axes: tuple[str, ...], n: int) -> Work:
    """ZeRO-3 / FSDP: batch and both weights split ``n`` ways; gather weights, reduce-scatter gradients."""
    w = _mlp_work(B // n, H, D, D)
    w.collectives += [("all_gather", F32 * D * H, axes)] * 2
    w.collectives += [("reduce_scatter", F32 * D * H, axes)] * 2
    w.collectives.append(("all_reduce", F32, axes))
    return w


def row_first(axes: tuple[str, ...], n: int) -> Work:
    """x and W1 split on the contraction dim D: the hidden activation is a partial sum (all-reduce of
    [B, H]); everything after it runs replicated."""
    w = Work(
        matmuls=[(B, H, D // n), (B, D, H), (H, D, B), (B, H, D), (D // n, H, B)],
        elementwise_bytes=F32 * (5 * B * H + 6 * B * D),
    )
    w.collectives.append(("all_reduce", F32 * B * H, axes))
    return w


def col_col(axes: tuple[str, ...], n: int) -> Work:
    """W1 and W2 both column-split: gather the hidden activation, reduce-scatter its gradient."""
    w = Work(
        matmuls=[(B, H // n, D), (B, D // n, H), (H, D // n, B), (B, H, D // n), (D, H // n, B)],
        elementwise_bytes=F32 * (5 * B * H // n + 6 * B * D // n),
    )
    w.collectives += [("all_gather", F32 * B * H, axes), ("reduce_scatter", F32 * B * H, axes)]
    w.collectives.append(("all_reduce", F32, axes))
    return w


@dataclass(frozen=True)
class Layout:
    name: str
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    x: P
    w1: P
    w2: P
    h: P  # hidden activation [B, H]
    o: P  # output [B, D]
    work: Callable[[], Work]


LAYOUTS = [
    Layout("replicated", (8,), ("d",), P(), P(), P(), P(), P(), lambda: megatron(1, 1, (), ())),
    Layout("dp8", (8,), ("d",), P("d"), P(), P(), P("d"), P("d"), lambda: megatron(8, 1, ("d",), ())),
    Layout(
        "mp8", (8,), ("m",), P(), P(None, "m"), P("m"), P(None, "m"), P(), lambda: megatron(1, 8, (), ("m",))
    ),
    Layout("fsdp8", (8,), ("d",), P("d"), P("d"), P("d"), P("d"), P("d"), lambda: fsdp(("d",), 8)),
    Layout(
        "dp2xmp4",
        (2, 4),
        ("d", "m"),
        P("d"),
        P(None, "m"),
        P("m"),
        P("d", "m"),
        P("d"),
        lambda: megatron(2, 4, ("d",), ("m",)),
    ),
    Layout(
        "dp4xmp2",
        (4, 2),
        ("d", "m"),
        P("d"),
        P(None, "m"),
        P("m"),
        P("d", "m"),
        P("d"),
        lambda: megatron(4, 2, ("d",), ("m",)),
    ),
    Layout(
        "dp2xrep4", (2, 4), ("d", "r"), P("d"), P(), P(), P("d"), P("d"), lambda: megatron(2, 1, ("d",), ())
    ),
    Layout(
        "dp8-2d",
        (2, 4),
        ("a", "b"),
        P(("a", "b")),
        P(),
        P(),
        P(("a", "b")),
        P(("a", "b")),
        lambda: megatron(8, 1, ("a", "b"), ()),
    ),
    Layout("row-first8", (8,), ("m",), P(None, "m"), P("m"), P(), P(), P(), lambda: row_first(("m",), 8)),
    Layout(
        "col-col8",
        (8,),
        ("m",),
        P(),
        P(None, "m"),
        P(None, "m"),
        P(None, "m"),
        P(None, "m"),
        lambda: col_col(("m",), 8),
    ),
]


def predict(model: CostModel, work: Work, overhead: float) -> float:
    t = sum(model.matmul_time(m, n, k, "float32") for m, n, k in work.matmuls)
    t += model.memory_time(work.elementwise_bytes)
    t += sum(model.collective_time(kind, nbytes, axes) for kind, nbytes, axes in work.collectives)
    return t + overhead


def compile_layout(layout: Layout) -> tuple[Callable[[], object], dict[str, int]]:
    """The jitted step on its arguments (a thunk that runs it once) and the collectives XLA compiled."""
    devices = np.asarray(jax.devices()[:8]).reshape(layout.mesh_shape)
    mesh = Mesh(devices, layout.axis_names)
    ns = lambda spec: NamedSharding(mesh, spec)  # noqa: E731

    def step(x, y, w1, w2):
        def loss_fn(w1, w2):
            h = jax.lax.with_sharding_constraint(x @ w1, ns(layout.h))
            o = jax.lax.with_sharding_constraint(jax.nn.relu(h) @ w2, ns(layout.o))
            return jnp.mean((o - y) ** 2)

        return jax.value_and_grad(loss_fn, argnums=(0, 1))(w1, w2)

    in_sh = (ns(layout.x), ns(layout.o), ns(layout.w1), ns(layout.w2))
    out_sh = (ns(P()), (ns(layout.w1), ns(layout.w2)))
    f = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh)
    rng = np.random.default_rng(0)
    args = [
        jax.device_put(rng.standard_normal(s, dtype=np.float32) * 0.05, sh)
        for s, sh in zip([(B, D), (B, D), (D, H), (H, D)], in_sh, strict=True)
    ]
    hlo = f.lower(*args).compile().as_text()
    counts = {
        k: len(re.findall(rf"\s{k}(?:-start)?\(", hlo))
        for k in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
    }
    for _ in range(2):
        jax.block_until_ready(f(*args))
    return (lambda: jax.block_until_ready(f(*args))), {k: v for k, v in counts.items() if v}


def measure_all(
    layouts: list[Layout], repeats: int, estimator: str = "median"
) -> list[tuple[float, dict[str, int]]]:
    """Median wall time per layout over ``repeats`` rounds; each round runs every layout once, so that
    load from other processes on the machine falls on all layouts alike."""
    runs = [compile_layout(lay) for lay in layouts]
    times: list[list[float]] = [[] for _ in layouts]
    for _ in range(repeats):
        for i, (run, _) in enumerate(runs):
            t0 = time.perf_counter()
            run()
            times[i].append(time.perf_counter() - t0)
    reduce = min if estimator == "min" else statistics.median
    return [(reduce(t), counts) for t, (_, counts) in zip(times, runs, strict=True)]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson correlation of the ranks (average ranks for ties)."""

    def ranks(v: list[float]) -> np.ndarray:
        v_arr = np.asarray(v)
        order = v_arr.argsort()
        r = np.empty(len(v_arr))
        r[order] = np.arange(len(v_arr), dtype=float)
        for val in np.unique(v_arr):
            r[v_arr == val] = r[v_arr == val].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "h100_fidelity.json")


def planner_rows(hardware: str, measure: bool, repeats: int, only: list[str]) -> list[dict[str, object]]:
    """One row per case: the plan's predicted peak memory and step time, the recorded (or, with ``measure``,
    freshly measured) XLA numbers."""
    import json

    import autoshard
    from autoshard._examples import load_example

    with open(CASES) as f:
        cases = json.load(f)["cases"]
    root = os.path.join(os.path.dirname(CASES), "..", "..")
    rows: list[dict[str, object]] = []
    for c in cases:
        name = f"{c['model']}:{c['preset']}:{c['dtype']}:{c['batch']}:{int(c['remat'])}"
        if only and not any(o in name for o in only):
            continue
        overrides = [f"dtype={c['dtype']}", f"batch={c['batch']}"] + (["remat=true"] if c["remat"] else [])
        path = os.path.join(root, "examples", f"{c['model']}.py")
        ex = load_example(path, c["preset"], overrides, abstract=True)
        plan = autoshard.plan(ex.train_step, *ex.args, mesh=(1,), hardware=hardware, time_budget_s=10)
        row: dict[str, object] = {**c, "case": name, f"pred_mem[{hardware}]": plan.peak_memory,
                                  f"pred_s[{hardware}]": plan.predicted_step_time}
        if measure:
            row.update(_measure_step(path, c["preset"], overrides, repeats))
        rows.append(row)
    return rows


def _measure_step(path: str, preset: str, overrides: list[str], repeats: int) -> dict[str, object]:
    from gpu_truth import time_steps, xla_memory  # beside this script

    from autoshard._examples import load_example

    ex = load_example(path, preset, overrides, abstract=False)
    compiled = jax.jit(ex.train_step, donate_argnums=0).lower(*ex.args).compile()
    out: dict[str, object] = {**xla_memory(compiled)}
    out["jit_median_s"], out["jit_min_s"] = time_steps(compiled, ex.args, repeats)
    return out


def planner_main(args: argparse.Namespace) -> int:
    import json

    rows = planner_rows(args.hardware, args.measure, args.repeats, args.cases)
    h = args.hardware
    print(f"{'case':<32} {'pred GB':>8} {'XLA GB':>8} {'ratio':>6}   {'pred ms':>8} {'meas ms':>8} {'ratio':>6}")
    for r in rows:
        pm, xm = float(r[f"pred_mem[{h}]"]), float(r["xla_peak_bytes"])  # type: ignore[arg-type]
        ps, xs = float(r[f"pred_s[{h}]"]), float(r["jit_median_s"])  # type: ignore[arg-type]
        print(f"{r['case']:<32} {pm / 1e9:8.2f} {xm / 1e9:8.2f} {pm / xm:6.2f}   {ps * 1e3:8.1f} {xs * 1e3:8.1f} "
              f"{ps / xs:6.2f}")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--planner", action="store_true", help="the planner against XLA on one device (see above)")
    ap.add_argument("--hardware", default="h100", help="planner mode: hardware preset or profile")
    ap.add_argument("--measure", action="store_true", help="planner mode: compile and time on the local device")
    ap.add_argument("--out", help="planner mode: append the rows as JSON lines to this file")
    ap.add_argument("cases", nargs="*", help="planner mode: only cases whose name contains one of these")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--profile", help="profile JSON (default: the newest shipped cpu-8dev profile)")
    src.add_argument("--quick-profile", action="store_true", help="profile the devices now (quick mode)")
    src.add_argument("--preset", help="use an analytic preset instead (e.g. cpu)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--estimator", choices=("median", "min"), default="median", help="how repeats are reduced"
    )
    args = ap.parse_args(argv)
    if args.planner:
        return planner_main(args)

    if args.quick_profile:
        from autoshard.profiler import ProfileConfig, run_profile

        profile: Profile = run_profile(ProfileConfig.quick(estimator=args.estimator))
    elif args.preset:
        profile = load_profile(args.preset)
    else:
        shipped = [p for p in shipped_profiles() if p.startswith("cpu-8dev")]
        if not args.profile and not shipped:
            print("no shipped cpu-8dev profile; pass --profile or --quick-profile", file=sys.stderr)
            return 2
        profile = load_profile(args.profile or shipped[-1])
    print(
        f"profile: {profile.name} (overhead {profile.overhead * 1e6:.0f} us); step: MLP B={B} D={D} H={H} fp32"
    )
    print(f"{'layout':<12} {'predicted ms':>12} {'measured ms':>12} {'rel err':>8}  collectives in HLO")
    pred = [
        predict(
            CostModel.load(profile, mesh_shape=lay.mesh_shape, axis_names=lay.axis_names),
            lay.work(),
            profile.overhead,
        )
        for lay in LAYOUTS
    ]
    measured = measure_all(LAYOUTS, args.repeats, args.estimator)
    meas = [m for m, _ in measured]
    for lay, p, (m, counts) in zip(LAYOUTS, pred, measured, strict=True):
        print(f"{lay.name:<12} {p * 1e3:12.2f} {m * 1e3:12.2f} {abs(p - m) / m:8.2f}  {counts}")
    rel = [abs(p - m) / m for p, m in zip(pred, meas, strict=True)]
    print(f"Spearman rank correlation: {spearman(pred, meas):.3f}")
    print(f"median relative error: {statistics.median(rel):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
