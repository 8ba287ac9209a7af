"""One process of the multi-process pipeline tests:
``python pipeline_worker.py PORT RANK NPROC OUTDIR SCHEDULE FORM``.

Every process has 4 CPU devices (gloo collectives); the (2, 4) mesh spans all of them. Each process builds
the example GPT with 4 blocks (tiny preset, same seed), keeps its own rows of the batch and runs 3 steps of
``parallelize(step, mesh=(2, 4), microbatches=4, pipeline=True, schedule=SCHEDULE, stage_shape=(1, 2))``:
one SPMD program over 4 stages of 2 devices (interleaved and ZB-V: 2 stages of 4 devices, 2 chunks each). ``FORM`` is ``state`` (the example's flax ``TrainState`` step)
or ``optax`` (the same model written ``step(params, opt_state, batch)`` over plain optax); ``:heavy`` after it
gives the model a tail worth spreading over stages (32768 words, planned for A100s). Process 0 writes
the losses, the parameters and the plan to ``OUTDIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# XLA_FLAGS: the test session's, less the device count (``multiproc.start``); jax_num_cpu_devices sets it here
os.environ["JAX_PLATFORMS"] = "cpu"

import jax

port, rank, nproc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out_dir, schedule, form = Path(sys.argv[4]), sys.argv[5], sys.argv[6]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import autoshard  # noqa: E402
from autoshard import distributed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_forms import make  # noqa: E402

distributed.initialize(f"localhost:{port}", nproc, rank, heartbeat_timeout_s=10)

train_step, args, batch = make(form)
args = jax.tree.map(np.asarray, args)  # the whole state, the same in every process
batch = jax.tree.map(np.asarray, batch)
rows = jax.tree.leaves(batch)[0].shape[0] // nproc
mine = jax.tree.map(lambda a: a[rank * rows : (rank + 1) * rows], batch)  # this process's part

# interleaved and ZB-V: 2 stages x 2 chunks of a block
shape = (1, 4) if schedule in ("interleaved-1f1b", "zb-v") else (1, 2)
step = autoshard.parallelize(train_step, mesh=(2, 4), microbatches=4, pipeline=True, schedule=schedule,
                             stage_shape=shape, time_budget_s=20,
                             **({"hardware": "a100"} if form.endswith(":heavy") else {}))
losses = []
state = args
for _ in range(3):
    *state, metrics = step(*state, mine)
    losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))

whole = multihost_utils.process_allgather(state, tiled=True)  # every leaf, every process
if rank == 0:
    leaves = {f"leaf_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(whole))}
    np.savez(out_dir / "result.npz", losses=np.array(losses), **leaves)
    (out_dir / "plan.json").write_text(json.dumps(step.plan.to_dict()))
print(json.dumps({"rank": rank, "devices": len(jax.devices()), "losses": losses,
                  "runtime": type(step._last.step.emitted).__name__}), flush=True)
jax.distributed.shutdown()
