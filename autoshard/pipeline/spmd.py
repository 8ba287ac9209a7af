"""An SPMD pipeline for identical stages: one program, ``jax.shard_map`` over a stage axis, ``ppermute``.

Where the stages are the same function with different weights (a stack of transformer blocks split
evenly), the pipeline needs no per-stage programs: every device of the stage axis runs the same
program on its own slice of the stacked weights, and activations move one stage down the axis per
tick with ``jax.lax.ppermute``. Being one SPMD program, it runs unchanged on one host or across hosts
under ``jax.distributed`` (multi-controller JAX).

The ticks are the IR's (``solvers.pipeline``): GPipe's program (``schedules.gpipe``) lowered to tables indexed
``[tick, stage]`` (``lowering.action_tables``), of which this helper runs the forward ticks: at tick ``t``
stage ``s`` runs the forward of microbatch ``f[t, s]`` (GPipe's ``t − s``; -1: none), stage 0 reading it from
the input, every stage passing its result to ``s + 1``, the last stage keeping its result for that
microbatch. Backward: ``jax.grad`` through the loop (the transpose of a ``ppermute`` is the reverse
``ppermute``), which gives GPipe's backward with all forwards' activations held, ``M + S − 1`` ticks.
Ticks where a stage has no microbatch compute on zeros and are masked out: the bubble is real work
here, as it is on hardware. ``autoshard.pipeline.spmd_program`` runs every schedule, a planned step's
stages and its backward as the program's own ticks; this helper is for a stack the user splits by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from autoshard.pipeline.partition import PipelineError
from solvers.pipeline.lowering import action_tables
from solvers.pipeline.schedules import gpipe


def spmd_pipeline(stage_fn: Callable[[Any, jax.Array], jax.Array], stage_params: Any, x: jax.Array, *,
                  mesh: jax.sharding.Mesh, axis: str, num_microbatches: int) -> jax.Array:
    """Apply ``S`` identical stages in sequence to ``x`` as a pipeline over mesh axis ``axis``.

    ``stage_params``: a pytree whose leaves have a leading dimension ``S`` (= the size of ``axis``),
    slice ``s`` being stage ``s``'s weights; ``stage_fn(params_s, h) -> h`` keeps ``h``'s shape.
    ``x``: ``[batch, ...]`` with ``batch`` divisible by ``num_microbatches``. Returns
    ``stage_fn(p_{S-1}, ... stage_fn(p_0, x))``, differentiable, computed as a GPipe pipeline.
    """
    if axis not in mesh.axis_names:
        raise PipelineError(f"mesh axes are {mesh.axis_names}; the stage axis {axis!r} is not one of them")
    S = mesh.shape[axis]
    M = num_microbatches
    leaves = jax.tree.leaves(stage_params)
    bad = [leaf.shape for leaf in leaves if not leaf.shape or leaf.shape[0] != S]
    if bad:
        raise PipelineError(f"every stage_params leaf needs a leading dimension of {S} (the size of mesh "
                            f"axis {axis!r}); got leaves of shapes {bad[:3]}")
    if x.shape[0] % M:
        raise PipelineError(f"batch of {x.shape[0]} rows does not split into {M} microbatches")
    micro = x.reshape(M, x.shape[0] // M, *x.shape[1:])
    perm = [(s, (s + 1) % S) for s in range(S)]
    tables = action_tables(gpipe(S, M))
    forward = tables.f_micro[: int(np.flatnonzero((tables.f_micro >= 0).any(axis=1)).max()) + 1]  # its ticks

    def body(params: Any, xs: jax.Array) -> jax.Array:
        params = jax.tree.map(lambda a: a[0], params)  # this device's stage
        s = jax.lax.axis_index(axis)
        zero = jnp.zeros_like(xs[0])

        def tick(carry: tuple[jax.Array, jax.Array], row: jax.Array) -> tuple[tuple[jax.Array, jax.Array], None]:
            h, outs = carry
            m = row[s]  # the microbatch this stage runs forward at this tick, or -1
            h = jnp.where(s == 0, xs[jnp.maximum(m, 0)], h)
            y = jnp.where(m >= 0, stage_fn(params, h), zero)
            at = jnp.maximum(m, 0)
            outs = outs.at[at].set(jnp.where((s == S - 1) & (m >= 0), y, outs[at]))
            return (jax.lax.ppermute(y, axis, perm), outs), None

        outs = jnp.zeros_like(xs)
        (_, outs), _ = jax.lax.scan(tick, (zero, outs), jnp.asarray(forward))
        # only the last stage holds the results: sum over the axis hands them to every device
        return jax.lax.psum(jnp.where(s == S - 1, outs, jnp.zeros_like(outs)), axis)

    spec_params = jax.tree.map(lambda _: P(axis), stage_params)
    run = jax.shard_map(body, mesh=mesh, in_specs=(spec_params, P()), out_specs=P(), check_vma=False)
    out = run(stage_params, micro)
    return out.reshape(x.shape[0], *out.shape[2:])
