"""The SPMD pipeline for identical stages: numerics on one process and across processes (jax.distributed)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import multiproc
import numpy as np
import pytest

from autoshard.pipeline import PipelineError
from autoshard.pipeline.spmd import spmd_pipeline

WORKER = Path(__file__).parent / "workers" / "spmd_pipeline_worker.py"


def stage_fn(p, h):
    return jnp.tanh(h @ p["w"] + p["b"])


def _data(S: int):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((S, 16, 16)) * 0.3).astype(np.float32)
    b = (rng.standard_normal((S, 16)) * 0.1).astype(np.float32)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    return {"w": jnp.asarray(w), "b": jnp.asarray(b)}, jnp.asarray(x)


def _sequential_loss(p, x):
    for s in range(p["w"].shape[0]):
        x = stage_fn({k: v[s] for k, v in p.items()}, x)
    return jnp.mean(x**2)


def _rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


@pytest.mark.parametrize("stages", [2, 4, 8])
@pytest.mark.parametrize("micro", [1, 4, 8])
def test_spmd_pipeline_matches_the_stages_applied_in_sequence(stages: int, micro: int) -> None:
    params, x = _data(stages)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:stages]), ("stage",))

    def loss(p, x):
        return jnp.mean(spmd_pipeline(stage_fn, p, x, mesh=mesh, axis="stage", num_microbatches=micro) ** 2)

    l_ref, g_ref = jax.value_and_grad(_sequential_loss)(params, x)
    l_pip, g_pip = jax.jit(jax.value_and_grad(loss))(params, x)
    assert _rel(l_ref, l_pip) <= 1e-5
    for k in ("w", "b"):
        assert _rel(g_ref[k], g_pip[k]) <= 1e-5


def test_spmd_pipeline_rejects_params_without_a_stage_dimension() -> None:
    params, x = _data(4)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("stage",))
    with pytest.raises(PipelineError, match="leading dimension of 2"):
        spmd_pipeline(stage_fn, params, x, mesh=mesh, axis="stage", num_microbatches=4)
    with pytest.raises(PipelineError, match="'pipe' is not one of them"):
        spmd_pipeline(stage_fn, params, x, mesh=mesh, axis="pipe", num_microbatches=4)


def test_spmd_pipeline_runs_unchanged_across_two_processes() -> None:
    # two processes of 2 CPU devices each (jax.distributed on localhost, gloo collectives): the stage
    # axis spans both; loss and gradients must match the single-process sequential computation
    result, _ = multiproc.run(WORKER, timeout=240)  # process 0 holds stage 0's gradient
    assert result["devices"] == 4
    params, x = _data(4)
    l_ref, g_ref = jax.value_and_grad(_sequential_loss)(params, x)
    assert _rel(l_ref, result["loss"]) <= 1e-5
    assert _rel(g_ref["w"], np.array(result["grad_w"])) <= 1e-5
