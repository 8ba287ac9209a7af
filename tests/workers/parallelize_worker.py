"""One process of the multi-process ``@autoshard.parallelize`` tests:
``python parallelize_worker.py PORT RANK NPROC OUTDIR MODE EXAMPLE [BUDGET]`` (``EXAMPLE``: ``gpt.py`` or
``gpt.py:ring=true,heads=1``, the tiny preset with those overrides) [BUDGET: the planner's seconds, 5].

Every process has 4 CPU devices (gloo collectives); the (2, 4) mesh spans all of them. Each process builds
the same tiny example (same seed), keeps its own rows of the batch and runs 3 steps of the decorated
train step. ``MODE`` is ``run`` (process 0 writes the losses, the optimizer state and the plan to
``OUTDIR``) or ``die:R`` (after step 1, process R says so on stdout and waits to be killed; the others go
on to step 2, whose collectives then have no partner) or ``disagree`` (process 1 keeps one row fewer, so
the processes trace different steps) or ``saved:PATH`` (every process runs the plan saved at PATH).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# XLA_FLAGS: the test session's, less the device count (``multiproc.start``); jax_num_cpu_devices sets it here
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

port, rank, nproc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out_dir, mode, example = Path(sys.argv[4]), sys.argv[5], sys.argv[6]
budget = float(sys.argv[7]) if len(sys.argv) > 7 else 5.0  # the planner's seconds
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autoshard  # noqa: E402
from autoshard import distributed  # noqa: E402
from autoshard._examples import load_example  # noqa: E402

distributed.initialize(f"localhost:{port}", nproc, rank, heartbeat_timeout_s=10)

ROOT = Path(__file__).resolve().parents[2]
name, _, sets = example.partition(":")  # "gpt.py:ring=true,heads=1": the example and its overrides
ex = load_example(ROOT / "examples" / name, "tiny", [x for x in sets.split(",") if x], abstract=False)
state, batch = jax.tree.map(np.asarray, ex.args)  # the whole example, the same in every process
rows = jax.tree.leaves(batch)[0].shape[0] // nproc
mine = jax.tree.map(lambda a: a[rank * rows : (rank + 1) * rows], batch)  # this process's part
if mode == "disagree" and rank == 1:
    mine = jax.tree.map(lambda a: a[:-1], mine)

if mode.startswith("saved:"):  # a plan saved by one process, run by every process (traced at the global size)
    step = autoshard.parallelize(ex.train_step, mesh=(2, 4), plan=mode.partition(":")[2])
else:
    step = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=budget)
losses = []
for i in range(3):
    if mode == f"die:{rank}" and i == 1:
        print("step 1 done", flush=True)
        time.sleep(600)  # the test kills this process here
    state, metrics = step(state, mine)
    losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))

whole = multihost_utils.process_allgather(state.opt_state, tiled=True)  # every leaf, every process

# batch parts assembled into layouts that split the rows over every device (each process hands over its
# own rows) and over "y" only (each process needs every row: staged, then moved)
x_all, x_mine = jax.tree.leaves(batch)[0], jax.tree.leaves(mine)[0]
assembled = {}
for name, spec in (("rows_split", P(("x", "y"))), ("rows_by_y", P("y"))) if x_all.shape[0] % 8 == 0 else ():
    sharding = NamedSharding(step.device_mesh, spec)
    direct = distributed._rows_of_this_process(sharding, x_all.shape)
    got = distributed._from_local_rows(x_mine, sharding, x_all.shape)
    same = bool(np.array_equal(multihost_utils.process_allgather(got, tiled=True), x_all))
    assembled[name] = {"direct": direct, "same": same, "sharding_kept": got.sharding == sharding}
if rank == 0:
    leaves = {f"opt_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(whole))}
    np.savez(out_dir / "result.npz", losses=np.array(losses), **leaves)
    (out_dir / "plan.json").write_text(json.dumps(step.plan.to_dict()))
print(json.dumps({"rank": rank, "devices": len(jax.devices()), "losses": losses, "assembled": assembled}),
      flush=True)
jax.distributed.shutdown()
