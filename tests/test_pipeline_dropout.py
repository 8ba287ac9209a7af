"""A model with dropout, pipelined: flax folds each module's path into the dropout key, so every block reads a
constant of its own (``uniform.UniformStages.stage_constants``), which the SPMD program feeds per stage as it
does the weights; the usual loop's key split (one half for dropout, the other returned) runs with the microbatches
and returns jax.jit's next key; each microbatch draws its rows of jax.jit's dropout mask (``pipeline.draws``), so
both runtimes give jax.jit's numbers, and a draw that cannot be split so is said; nnx dropout (each module
counting its own random numbers) runs as the SPMD program with nnx.jit's numbers; blocks with float state of
their own are refused by name."""

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
def test_a_pipelined_dropout_model_draws_jits_masks_on_both_runtimes(
        schedule: str, legacy_key: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The step splits its key, drops out with one half and returns the other (the split read no batch and no
    gradient, and fed both the blocks and the returned state: the MPMD runtime failed with a bare
    ``KeyError``, ``partition.split_step`` left it to the update): over 2 steps both runtimes give jax.jit's
    loss, parameters and next key, each microbatch drawing its rows of jit's masks (before, every microbatch
    drew the first one's: loss 6.4805 against 6.4780), and nothing is warned."""
    state, batch, rng = _args(legacy_key)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        mpmd = autoshard.parallelize(_splitting_step, runtime="mpmd", schedule=schedule, **PIPE)
        spmd = autoshard.parallelize(_splitting_step, runtime="spmd", schedule=schedule, **PIPE)
        s_j = s_m = s_s = state
        k_j = k_m = k_s = rng
        for _ in range(2):
            s_j, l_j, k_j = jax.jit(_splitting_step)(s_j, batch, k_j)
            s_m, l_m, k_m = mpmd(s_m, batch, k_m)
            s_s, l_s, k_s = spmd(s_s, batch, k_s)
            for s_p, l_p, k_p in ((s_m, l_m, k_m), (s_s, l_s, k_s)):
                assert global_rel_error(l_j, l_p) <= TOL
                assert global_rel_error(s_j.params, s_p.params) <= TOL
                assert (_key_data(k_p) == _key_data(k_j)).all()
    assert isinstance(spmd.plan, PipelinePlan) and spmd.plan.spmd and len(spmd.plan.stages) == 4
    assert "draws the same numbers" not in caplog.text


class _HeadTailDropout(_Model):
    """Dropout outside the blocks too: on the embedding (the head) and before the output layer (the tail),
    draws that read no batch value and none of a block's (the SPMD program once ran them before the loop,
    once a step: every microbatch got the first one's mask)."""

    def setup(self) -> None:
        super().setup()
        self.drop_in, self.drop_out = nn.Dropout(0.1), nn.Dropout(0.2)

    def __call__(self, ids: jax.Array, mask: jax.Array, deterministic: bool = True) -> jax.Array:
        x = self.drop_in(self.emb(ids), deterministic=deterministic)
        for block in self.h:
            x = block(x, mask, deterministic)
        return self.out(self.drop_out(x, deterministic=deterministic))


def test_dropout_in_the_head_and_a_tail_spread_over_stages_draws_jits_masks() -> None:
    """The SPMD program with the tail spread over 2 of its 4 stages (each runs half of each microbatch's rows:
    ``tail_graph``'s trace, its draws offset by the half's place among the batch's rows): 2 steps give
    jax.jit's losses and parameters."""
    from autoshard.pipeline.partition import trace_microbatch
    from autoshard.pipeline.spmd_program import SpmdPipelineStep, stage_mesh

    _, batch, rng = _args(False)
    model = _HeadTailDropout()
    params = model.init(jax.random.key(0), batch["ids"], batch["mask"])["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    M, split = 4, 2
    full = autoshard.trace(_train_step, state, batch, rng)
    micro = trace_microbatch(_train_step, (state, batch, rng), full, M)
    small = trace_microbatch(_train_step, (state, batch, rng), full, M * split)
    step = SpmdPipelineStep(micro, full, stage_mesh(jax.devices()[:4], 4), M, "1f1b", tail=small)
    assert step.spread is not None and step.spread.split == split and step.random_exact
    s_j = s_p = state
    for k in range(2):
        key = jax.random.fold_in(rng, k)
        s_j, l_j = jax.jit(_train_step)(s_j, batch, key)
        s_p, l_p = step(s_p, batch, key)
        assert global_rel_error(l_j, l_p) <= TOL and global_rel_error(s_j.params, s_p.params) <= TOL


@pytest.mark.slow  # CI: the intra-operator plan against jax.jit in many other tests (CI time)
def test_the_intra_operator_plan_of_a_dropout_model_draws_as_jit_does(caplog: pytest.LogCaptureFixture) -> None:
    state, batch, rng = _args(False)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        par = autoshard.parallelize(_train_step, mesh=(2, 4), hardware="h100", time_budget_s=5)
        s_p, l_p = par(state, batch, rng)
    s_j, l_j = jax.jit(_train_step)(state, batch, rng)
    assert global_rel_error(l_j, l_p) <= TOL and global_rel_error(s_j.params, s_p.params) <= TOL
    assert "draws the same numbers" not in caplog.text


def _nnx_model(kind: str = "dropout") -> tuple[Any, Any]:
    """An nnx model with ``Dropout`` before, in and after its 4 blocks (each holds an RNG counter that every call
    advances: state of its own the step returns); with ``kind`` "norm" a ``BatchNorm`` in each block instead of
    its dropout, with "count" an integer count of the block's positive outputs kept as its state."""
    from flax import nnx

    class Count(nnx.Variable):
        pass

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.fc = nnx.Linear(16, 16, rngs=rngs)
            self.drop = nnx.BatchNorm(16, rngs=rngs) if kind == "norm" else nnx.Dropout(0.1, rngs=rngs)
            self.seen = Count(jnp.zeros((), jnp.int32))

        def __call__(self, x: jax.Array) -> jax.Array:
            y = x + self.drop(jnp.tanh(self.fc(x)))
            if kind == "count":
                self.seen[...] = jnp.sum(y > 0).astype(jnp.int32)
            return y

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.inp = nnx.Linear(16, 16, rngs=rngs)
            self.drop_in = nnx.Dropout(0.2, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(4)])
            self.drop_out = nnx.Dropout(0.3, rngs=rngs)
            self.out = nnx.Linear(16, 16, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = self.drop_in(self.inp(x))
            for b in self.blocks:
                x = b(x)
            return self.out(self.drop_out(x))

    model = Model(nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _nnx_step(model: Any, opt: Any, x: jax.Array) -> jax.Array:
    from flax import nnx

    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    with jax.numpy_dtype_promotion("standard"):
        opt.update(model, grads)
    return loss


def test_nnx_dropout_counting_its_own_random_numbers_runs_as_the_spmd_program_as_nnx_jit() -> None:
    """Each nnx ``Dropout`` advances an RNG counter of its own every call, the same for every microbatch: the
    SPMD program keeps each block's (``UniformStages.f_state``) and the head's and tail's (where it once refused
    the model), and over 2 steps gives ``nnx.jit``'s losses, parameters and counters."""
    from flax import nnx

    x = jax.random.normal(jax.random.key(3), (8, 16))
    (m_j, o_j), (m_p, o_p) = _nnx_model(), _nnx_model()
    par = autoshard.parallelize(_nnx_step, runtime="spmd", **PIPE)
    for _ in range(2):
        l_j, l_p = nnx.jit(_nnx_step)(m_j, o_j, x), par(m_p, o_p, x)
        assert global_rel_error(l_j, l_p) <= TOL
        assert global_rel_error(nnx.state(m_j, nnx.Param), nnx.state(m_p, nnx.Param)) <= TOL
        counts = [jax.tree.leaves(nnx.state(m, nnx.RngCount)) for m in (m_j, m_p)]
        assert all(int(a) == int(b) for a, b in zip(*counts, strict=True)) and int(counts[1][0]) > 0
    assert isinstance(par.plan, PipelinePlan) and par.plan.spmd


@pytest.mark.parametrize("kind,runtime,why", [
    ("norm", "spmd", "running statistics.*runtime='mpmd' on one process"),
    ("count", "spmd", "seen.*count of its tokens.*plan without microbatches"),
    ("count", "mpmd", "seen.*count of its tokens.*plan without microbatches")])
def test_state_of_a_blocks_own_made_per_microbatch_is_refused_with_why(kind: str, runtime: str, why: str) -> None:
    """State of each block's own that differs per microbatch: a batch norm's running statistics (floats), which
    the SPMD program does not average (the MPMD runtime does); a count made from the microbatch (an integer, which
    an RNG counter is not), which no pipeline can give as the whole batch's (the MPMD runtime kept the first
    microbatch's, silently): refused by name with what to do."""
    from autoshard.pipeline.partition import PipelineError

    model, opt = _nnx_model(kind)
    par = autoshard.parallelize(_nnx_step, runtime=runtime, **PIPE)
    with pytest.raises(PipelineError, match=why):
        par(model, opt, jnp.ones((8, 16), jnp.float32))


def test_only_draws_a_pipeline_cannot_make_jits_are_warned_about() -> None:
    """``random_note`` speaks only of draws that run per microbatch and cannot be split by rows as jax.jit
    draws them: not of noise added to the gradients after ``value_and_grad`` (drawn in the update, once a step),
    nor of dropout over the batch's rows (each microbatch draws its rows of jit's mask); of a mask whose
    dimension 0 is not the batch's (time-major), yes."""
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

    def time_major(state: TrainState, batch: dict[str, jax.Array], rng: jax.Array) -> tuple[TrainState, jax.Array]:
        def loss_fn(p: Any) -> jax.Array:
            h = state.apply_fn({"params": p}, batch["ids"], batch["mask"])
            keep = jax.random.bernoulli(rng, 0.9, (h.shape[1], h.shape[0], h.shape[2]))  # [T, rows, vocab]
            return jnp.mean((h * jnp.swapaxes(keep, 0, 1).astype(h.dtype)) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        with jax.numpy_dtype_promotion("standard"):
            return state.apply_gradients(grads=grads), loss

    state, batch, rng = _args(False)
    for step, expect in ((noisy, False), (_train_step, False), (time_major, True)):
        full = autoshard.trace(step, state, batch, rng)
        micro = trace_microbatch(step, (state, batch, rng), full, 4)
        assert (random_note(micro, full, 4) is not None) == expect, step.__name__


def test_a_block_of_rows_draws_those_rows_of_the_whole_draw() -> None:
    """``offset_bits``: block ``i`` of ``b`` rows is rows ``i·b .. (i+1)·b`` of ``jax.random.bits`` over all the
    rows, at 8, 16 and 32 bits, the block index traced; the 64-bit offset's words are ``a · n`` for values
    whose product passes 2**32 (a draw of billions of elements)."""
    from autoshard.emit.draws import _mul64, offset_bits

    key = jax.random.key(7)
    for bits, dtype in ((8, jnp.uint8), (16, jnp.uint16), (32, jnp.uint32)):
        whole = jax.random.bits(key, (12, 3, 5), dtype)
        block = jax.jit(lambda k, i, bits=bits: offset_bits(k, bits, (3, 3, 5), i))
        for i in range(4):
            assert (block(key, jnp.int32(i)) == whole[3 * i:3 * (i + 1)]).all(), (bits, i)
    for a in (0, 1, 65535, 65536, 123457, 2**31 - 1, 2**32 - 1):
        for n in (1, 65537, 2**31 + 5, 2**32 - 1):
            hi, lo = _mul64(jnp.uint32(a), n)
            assert (int(hi) << 32 | int(lo)) == a * n
