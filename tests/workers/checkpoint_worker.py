"""One process of the multi-process checkpoint tests:
``python checkpoint_worker.py PORT RANK NPROC OUTDIR MODE`` with 4 CPU devices a process (gloo collectives)
and the tiny GPT (its rows of the batch to each process), on a mesh of every device on one axis.

``MODE``: ``restore:DIR``: restore the newest step under DIR (saved by another process count), write the
restored state (process 0, gathered) to ``OUTDIR/restored.npz`` and train 3 steps; ``train:DIR:N``: restore
the newest step under DIR if there is one (else start afresh), then train until step N, saving every step
(``step K saved`` on stdout after each). The last line of stdout is a JSON report: the losses, the step
restored.
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
out_dir, mode = Path(sys.argv[4]), sys.argv[5]
jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_numpy_dtype_promotion", "strict")

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import autoshard  # noqa: E402
from autoshard import checkpoint, distributed  # noqa: E402
from autoshard._examples import load_example  # noqa: E402

if nproc > 1:
    distributed.initialize(f"localhost:{port}", nproc, rank, heartbeat_timeout_s=10)

ROOT = Path(__file__).resolve().parents[2]
ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=False)
state, batch = jax.tree.map(np.asarray, ex.args)
rows = batch["tokens"].shape[0] // nproc
mine = {"tokens": batch["tokens"][rank * rows : (rank + 1) * rows]}  # this process's rows
like = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=True).args[0]  # shapes only

step = autoshard.parallelize(ex.train_step, mesh=(len(jax.devices()),), time_budget_s=5)
kind, _, rest = mode.partition(":")
directory, _, until = rest.partition(":")
restored = None
if kind == "restore" or checkpoint.latest_step(directory) is not None:
    restored = checkpoint.latest_step(directory)
    state = step.restore(directory, like=like, args=(like, mine))
    if kind == "restore":
        whole = multihost_utils.process_allgather(state, tiled=True) if nproc > 1 else state
        if rank == 0:
            np.savez(out_dir / "restored.npz", **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(whole))})

losses = []
first = 0 if restored is None else restored
last = first + 3 if kind == "restore" else int(until)
for k in range(first + 1, last + 1):
    state, metrics = step(state, mine)
    loss = metrics["loss"]
    losses.append(float(np.asarray(loss.addressable_data(0) if isinstance(loss, jax.Array) else loss)))
    if kind == "train":
        step.save(directory, state, k)
        print(f"step {k} saved", flush=True)
print(json.dumps({"rank": rank, "restored": restored, "losses": losses, "devices": len(jax.devices())}), flush=True)
if nproc > 1:
    jax.distributed.shutdown()
