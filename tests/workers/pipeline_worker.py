"""One process of the multi-process pipeline tests:
``python pipeline_worker.py PORT RANK NPROC OUTDIR SCHEDULE FORM [SCHEDULE FORM ...]``.

Every process has 4 CPU devices (gloo collectives); the (2, 4) mesh spans all of them. For each case (a
schedule and a step, ``pipeline_forms.make(FORM)``: the example GPT with 4 blocks, tiny preset, same seed, or a
model written as users write them), each process keeps its own rows of the batch and runs 3 steps of
``parallelize(step, mesh=(2, 4), microbatches=4, pipeline=True, schedule=SCHEDULE, stage_shape=(1, 2))``:
one SPMD program over 4 stages of 2 devices (interleaved and ZB-V: 2 stages of 4 devices, 2 chunks each). ``FORM`` is ``state`` (the example's flax ``TrainState`` step)
or ``optax`` (the same model written ``step(params, opt_state, batch)`` over plain optax); ``:heavy`` after it
gives the model a tail worth spreading over stages (32768 words, planned for A100s). The cases run one after
another in this one distributed session (one start, one JAX import: CI runs several). Process 0 writes case
``k``'s losses, parameters and plan to ``OUTDIR/k``; each process prints one JSON report, a list with an
entry per case.
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
out_dir, cases = Path(sys.argv[4]), list(zip(sys.argv[5::2], sys.argv[6::2], strict=True))
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import autoshard  # noqa: E402
from autoshard import distributed  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pipeline_forms import make  # noqa: E402

distributed.initialize(f"localhost:{port}", nproc, rank, heartbeat_timeout_s=10)


made: dict[str, tuple] = {}  # a step made once for all its schedules (Llama's init compiles for seconds)


def run(k: int, schedule: str, form: str) -> dict:
    t0 = time.perf_counter()
    if form not in made:
        made[form] = make(form)
    train_step, args, batch = made[form]
    args = jax.tree.map(np.asarray, args)  # the whole state, the same in every process
    batch = jax.tree.map(np.asarray, batch)
    rows = jax.tree.leaves(batch)[0].shape[0] // nproc
    mine = jax.tree.map(lambda a: a[rank * rows : (rank + 1) * rows], batch)  # this process's part

    # interleaved and ZB-V: 2 stages x 2 chunks of a block
    shape = (1, 4) if schedule in ("interleaved-1f1b", "zb-v") else (1, 2)
    # a short budget (the numbers do not depend on it), but for the heavy tail, whose spread the test asks for
    heavy = form.endswith(":heavy")
    step = autoshard.parallelize(train_step, mesh=(2, 4), microbatches=4, pipeline=True, schedule=schedule,
                                 stage_shape=shape, time_budget_s=20 if heavy else 5,
                                 **({"hardware": "a100"} if heavy else {}))
    losses = []
    state = args
    for _ in range(3):
        *state, metrics = step(*state, mine)
        losses.append(float(np.asarray(metrics["loss"].addressable_data(0))))

    whole = multihost_utils.process_allgather(state, tiled=True)  # every leaf, every process
    if rank == 0:
        (out_dir / str(k)).mkdir(exist_ok=True)
        leaves = {f"leaf_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(whole))}
        np.savez(out_dir / str(k) / "result.npz", losses=np.array(losses), **leaves)
        (out_dir / str(k) / "plan.json").write_text(json.dumps(step.plan.to_dict()))
    return {"rank": rank, "devices": len(jax.devices()), "losses": losses,
            "runtime": type(step._last.step.emitted).__name__, "seconds": round(time.perf_counter() - t0, 1)}


print(json.dumps([run(k, schedule, form) for k, (schedule, form) in enumerate(cases)]), flush=True)
jax.distributed.shutdown()
