"""What a checkpoint costs: seconds per GB to save a GPT train state as a plan lays it out and to restore it
under another layout (``autoshard.checkpoint``, orbax), on the 8 CPU devices of this machine.

The state (parameters and AdamW's two moments, float32) is made of random numbers (orbax's zarr chunks
compress zeros to nothing) directly in the layout of the plan for ``--save-mesh`` (``autoshard.plan``,
abstract: nothing of the step runs), saved, deleted, and restored in the layout of the plan for
``--restore-mesh`` (or, with ``--even``, split evenly over that mesh: no planning); every leaf is then
compared bit for bit with the host's copy of what was saved. Reads may come from the page cache (nothing
here drops it: the machine is shared), so the restore figure is a lower bound for a cold disk.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 nice -n 10 python benchmarks/checkpoint_io.py \\
        --preset 350m --dir /tmp/ckpt_bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("AUTOSHARD_CACHE_DIR", "off")

import jax
import numpy as np

import autoshard
from autoshard import checkpoint
from autoshard._examples import load_example
from autoshard.emit.specs import named_sharding
from autoshard.target import parse_mesh

ROOT = Path(__file__).resolve().parents[1]


def mesh_of(text: str) -> jax.sharding.Mesh:
    shape, names = parse_mesh(text)
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def plan_shardings(ex: object, state: object, mesh: jax.sharding.Mesh, seconds: float) -> object:
    """The state's leaves laid out as the plan for ``mesh`` lays the step's inputs (the state's come first)."""
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=dict(zip(mesh.axis_names, mesh.devices.shape, strict=True)),
                          hardware="h100", time_budget_s=seconds, pipeline=False)
    leaves, tree = jax.tree_util.tree_flatten(state)
    return jax.tree_util.tree_unflatten(tree, [named_sharding(mesh, t.spec) for t in plan.inputs[: len(leaves)]])


def random_state(like: object, shardings: object, seed: int = 0) -> object:
    """Random leaves made shard by shard on the host, straight into ``shardings`` (no whole leaf anywhere)."""
    rng = np.random.default_rng(seed)

    def one(x: jax.ShapeDtypeStruct, s: jax.sharding.Sharding) -> jax.Array:
        def part(idx: tuple[slice, ...]) -> np.ndarray:
            shape = tuple(len(range(*sl.indices(d))) for sl, d in zip(idx, x.shape, strict=True))
            if np.issubdtype(x.dtype, np.floating):
                return rng.standard_normal(shape, dtype=np.float32).astype(x.dtype)
            return rng.integers(0, 1000, shape).astype(x.dtype)

        return jax.make_array_from_callback(x.shape, s, part)

    return jax.tree.map(one, like, shardings)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="125m")
    p.add_argument("--save-mesh", default="2x4")
    p.add_argument("--restore-mesh", default="4x2")
    p.add_argument("--even", action="store_true", help="even layouts on both meshes instead of planned ones")
    p.add_argument("--time-budget", type=float, default=20.0, help="planner seconds per plan")
    p.add_argument("--dir", default="/tmp/autoshard_checkpoint_bench")
    p.add_argument("--out", help="append the result as one JSON line to this file")
    args = p.parse_args()

    ex = load_example(ROOT / "examples" / "gpt.py", args.preset, ["batch=8"], abstract=True)
    like = ex.args[0]
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(like))
    save_mesh, restore_mesh = mesh_of(args.save_mesh), mesh_of(args.restore_mesh)
    t0 = time.perf_counter()
    if args.even:
        save_sh, restore_sh = (checkpoint.even_shardings(like, m) for m in (save_mesh, restore_mesh))
    else:
        save_sh = plan_shardings(ex, like, save_mesh, args.time_budget)
        restore_sh = plan_shardings(ex, like, restore_mesh, args.time_budget)
    t_plan = time.perf_counter() - t0
    state = random_state(like, save_sh)
    jax.block_until_ready(state)
    shutil.rmtree(args.dir, ignore_errors=True)
    t0 = time.perf_counter()
    checkpoint.save(args.dir, state, 1)
    t_save = time.perf_counter() - t0
    host = [np.asarray(x) for x in jax.tree.leaves(state)]  # for the bitwise check, then the devices' copy goes
    del state
    t0 = time.perf_counter()
    back = checkpoint.restore(args.dir, like, shardings=restore_sh)
    jax.block_until_ready(back)
    t_restore = time.perf_counter() - t0
    same = all(np.array_equal(h, np.asarray(x)) for h, x in zip(host, jax.tree.leaves(back), strict=True))
    on_disk = sum(f.stat().st_size for f in Path(args.dir).rglob("*") if f.is_file())
    gb = nbytes / 1e9
    row = {"preset": args.preset, "leaves": len(host), "state_gb": round(gb, 3), "on_disk_gb": round(on_disk / 1e9, 3),
           "save_mesh": args.save_mesh, "restore_mesh": args.restore_mesh,
           "layouts": "even" if args.even else "planned", "plan_s": round(t_plan, 1),
           "save_s": round(t_save, 2), "restore_s": round(t_restore, 2),
           "save_s_per_gb": round(t_save / gb, 2), "restore_s_per_gb": round(t_restore / gb, 2),
           "bit_equal": same, "cpus": os.cpu_count(), "python": sys.version.split()[0], "jax": jax.__version__}
    print(json.dumps(row))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
