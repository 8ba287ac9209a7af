"""One process of the multi-process SPMD pipeline test: ``python spmd_pipeline_worker.py PORT RANK N``.

Each process has 2 CPU devices; the stage axis spans all processes' devices. Prints the loss and the
gradient's norm from process 0 as JSON.
"""

from __future__ import annotations

import json
import sys

# XLA_FLAGS: the test session's, less the device count (``multiproc.start``); jax_num_cpu_devices sets it here
import jax

port, rank, nproc = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
jax.config.update("jax_num_cpu_devices", 2)
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=rank)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from autoshard.pipeline.spmd import spmd_pipeline  # noqa: E402

S = len(jax.devices())
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("stage",))
rng = np.random.default_rng(0)  # the same numbers in every process
w = (rng.standard_normal((S, 16, 16)) * 0.3).astype(np.float32)
b = (rng.standard_normal((S, 16)) * 0.1).astype(np.float32)
x = rng.standard_normal((32, 16)).astype(np.float32)


def global_array(a: np.ndarray, spec: P) -> jax.Array:
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda idx: a[idx])


params = {"w": global_array(w, P("stage")), "b": global_array(b, P("stage"))}
xg = global_array(x, P())


def stage_fn(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def loss(p, x):
    return jnp.mean(spmd_pipeline(stage_fn, p, x, mesh=mesh, axis="stage", num_microbatches=8) ** 2)


value, grads = jax.jit(jax.value_and_grad(loss), out_shardings=NamedSharding(mesh, P()))(params, xg)
gw = np.asarray(jax.device_get(grads["w"].addressable_data(0)))
print(json.dumps({"devices": S, "loss": float(np.asarray(value.addressable_data(0))),  # this process's part
                  "grad_w": gw.tolist()}))
jax.distributed.shutdown()
