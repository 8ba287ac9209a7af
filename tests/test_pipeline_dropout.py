"""A model with dropout, pipelined: flax folds each module's path into the dropout key, so every block reads a
constant of its own (``uniform.UniformStages.stage_constants``), which the SPMD program feeds per stage as it
does the weights; the usual loop's key split (one half for dropout, the other returned) runs with the microbatches
and returns jax.jit's next key; a pipeline draws each microbatch's numbers with the key it is given, which is not
what the unpipelined step draws, and says so; nnx blocks counting their own random numbers are refused by name."""

from __future__ import annotations

import functools
import logging
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState

import autoshard
from autoshard.emit import global_rel_error
from autoshard.pipeline import PipelinePlan

TOL = 1e-5


class _Block(nn.Module):  # setup-style, as Hugging Face's Flax models write theirs
    d: int

    def setup(self) -> None:
        self.ln = nn.LayerNorm()
        self.fc1 = nn.Dense(2 * self.d)
        self.fc2 = nn.Dense(self.d)
        self.drop = nn.Dropout(0.1)

    def __call__(self, x: jax.Array, mask: jax.Array, deterministic: bool) -> jax.Array:
        h = self.fc2(nn.gelu(self.fc1(self.ln(x)))) * mask[..., None]
        return x + self.drop(h, deterministic=deterministic)


class _Model(nn.Module):
    d: int = 32
    n: int = 4

    def setup(self) -> None:
        self.emb = nn.Embed(64, self.d)
        self.h = [_Block(self.d) for _ in range(self.n)]  # named h_0 ... h_3
        self.out = nn.Dense(64)

    def __call__(self, ids: jax.Array, mask: jax.Array, deterministic: bool = True) -> jax.Array:
        x = self.emb(ids)
        for block in self.h:
            x = block(x, mask, deterministic)
        return self.out(x)


def _train_step(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array) -> tuple[TrainState, jax.Array]:
    def loss_fn(p: Any) -> jax.Array:
        logits = state.apply_fn({"params": p}, batch["ids"], batch["mask"], deterministic=False,
                                rngs={"dropout": rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["ids"][:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes a Python float and an int32 count
        return state.apply_gradients(grads=grads), loss


def _splitting_step(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array) -> tuple[Any, ...]:
    """The usual loop's step: split the key, drop out with one half, return the other for the next step."""
    rng, sub = jax.random.split(rng)
    state, loss = _train_step(state, batch, sub)
    return state, loss, rng


def _key_data(key: jax.Array) -> np.ndarray:
    return np.asarray(jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key)


@functools.cache
def _args(legacy_key: bool) -> tuple[Any, ...]:
    model = _Model()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (16, 16)), jnp.int32)
    mask = jnp.ones((16, 16), jnp.float32).at[:, -3:].set(0.0)  # padding every block reads
    params = model.init(jax.random.key(0), ids, mask)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    rng = jax.random.PRNGKey(1) if legacy_key else jax.random.key(1)
    return state, {"ids": ids, "mask": mask}, rng


PIPE = dict(mesh=(1, 4), microbatches=4, pipeline=True, stage_shape=(1, 1), hardware="h100", time_budget_s=5)


# ZB-H1 (the weight pass's groups read the stage constants too) and a legacy uint32 key: -m slow (CI time)
@pytest.mark.parametrize("schedule,legacy_key", [("1f1b", False), pytest.param("zb-h1", True, marks=pytest.mark.slow)])
def test_a_dropout_model_runs_as_the_spmd_program_as_the_mpmd_runtime_runs_it(
        schedule: str, legacy_key: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The step splits its key, drops out with one half and returns the other (the split read no batch and no
    gradient, and fed both the blocks and the returned state: the MPMD runtime failed with a bare
    ``KeyError``, ``partition.split_step`` left it to the update): both runtimes return jax.jit's next key
    and each other's numbers."""
    state, batch, rng = _args(legacy_key)
    _, _, next_key = jax.jit(_splitting_step)(state, batch, rng)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        mpmd = autoshard.parallelize(_splitting_step, runtime="mpmd", schedule=schedule, **PIPE)
        spmd = autoshard.parallelize(_splitting_step, runtime="spmd", schedule=schedule, **PIPE)
        s_m = s_s = state
        k_m = k_s = rng
        for _ in range(2):
            s_m, l_m, k_m = mpmd(s_m, batch, k_m)
            s_s, l_s, k_s = spmd(s_s, batch, k_s)
            assert global_rel_error(l_m, l_s) <= TOL
            assert global_rel_error(s_m.params, s_s.params) <= TOL
            if next_key is not None:  # the first step's
                assert (_key_data(k_m) == _key_data(next_key)).all() and (_key_data(k_s) == _key_data(next_key)).all()
                next_key = None
    assert isinstance(spmd.plan, PipelinePlan) and spmd.plan.spmd and len(spmd.plan.stages) == 4
    assert "every microbatch draws the same numbers" in caplog.text


@pytest.mark.slow  # CI: the intra-operator plan against jax.jit in many other tests (CI time)
def test_the_intra_operator_plan_of_a_dropout_model_draws_as_jit_does(caplog: pytest.LogCaptureFixture) -> None:
    state, batch, rng = _args(False)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        par = autoshard.parallelize(_train_step, mesh=(2, 4), hardware="h100", time_budget_s=5)
        s_p, l_p = par(state, batch, rng)
    s_j, l_j = jax.jit(_train_step)(state, batch, rng)
    assert global_rel_error(l_j, l_p) <= TOL and global_rel_error(s_j.params, s_p.params) <= TOL
    assert "draws the same numbers" not in caplog.text


def test_nnx_blocks_counting_their_own_random_numbers_are_refused_by_the_spmd_program_with_why() -> None:
    """An nnx ``Dropout`` holds an RNG counter that each block advances (state the blocks hand on, not a
    gradient): the SPMD program names it and what to do, where it once blamed an auxiliary loss."""
    from flax import nnx

    from autoshard.pipeline.partition import PipelineError

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.fc = nnx.Linear(16, 16, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return x + self.drop(jnp.tanh(self.fc(x)))

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.inp = nnx.Linear(16, 16, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(2)])

        def __call__(self, x: jax.Array) -> jax.Array:
            for b in self.blocks:
                x = b(self.inp(x) if b is self.blocks[0] else x)
            return x

    def step(model: Model, opt: nnx.Optimizer, x: jax.Array) -> jax.Array:
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        with jax.numpy_dtype_promotion("standard"):
            opt.update(model, grads)
        return loss

    model = Model(nnx.Rngs(0, dropout=1))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    par = autoshard.parallelize(step, runtime="spmd", **dict(PIPE, mesh=(1, 2)))
    with pytest.raises(PipelineError, match=r"update state of their own .*drop.*uint32.*runtime='mpmd'"):
        par(model, opt, jnp.ones((8, 16), jnp.float32))


def test_random_numbers_drawn_once_a_step_in_the_update_are_not_warned_about() -> None:
    """Noise added to the gradients after ``value_and_grad`` is drawn in the update, once a step as jax.jit
    draws it: ``random_note`` speaks only of draws that run per microbatch."""
    from autoshard.pipeline.partition import trace_microbatch
    from autoshard.pipeline.report import random_note

    def noisy(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array) -> tuple[TrainState, jax.Array]:
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch["ids"],
                                                                          batch["mask"]) ** 2))(state.params)
        leaves, tree = jax.tree.flatten(grads)
        keys = jax.random.split(rng, len(leaves))
        grads = tree.unflatten([g + 1e-3 * jax.random.normal(k, g.shape) for g, k in zip(leaves, keys, strict=True)])
        with jax.numpy_dtype_promotion("standard"):
            return state.apply_gradients(grads=grads), loss

    state, batch, rng = _args(False)
    for step, expect in ((noisy, False), (_train_step, True)):
        micro = trace_microbatch(step, (state, batch, rng), autoshard.trace(step, state, batch, rng), 4)
        assert (random_note(micro) is not None) == expect, step.__name__
