"""Attention through a custom Pallas kernel, and the one line that lets autoshard plan around it.

    x [batch, seq, hidden] ─▶ qkv (Dense) ─▶ flash_attention(q, k, v) per head ─▶ out (Dense) ─▶ MSE

``flash_attention`` is a Pallas kernel (online softmax over blocks of keys, as in FlashAttention), written
with ``interpret=True`` so that it runs on CPU; its backward pass recomputes plain attention
(``jax.custom_vjp``). To the planner a kernel is an opaque ``pallas_call``: without a rule its operands and
results are replicated, with a warning. The ``autoshard.register_rule`` call below says, per operand and
result, which dimensions the kernel may be split along (batch and heads: its work is independent over
them; the sequence and head dimensions stay whole) and how many flops it does, so a plan can split the
kernel's work like any other op's.

Batch: ``{"x": float32 [batch, seq, hidden], "y": float32 [batch, seq, hidden]}`` (regression targets).

Run one step planned on a 2x4 mesh, against ``jax.jit``:
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/flash_attention.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState
from jax.experimental import pallas as pl

import autoshard


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    hidden: int = 32
    heads: int = 4
    seq_len: int = 32
    block: int = 16  # rows of queries per kernel program, and keys per step of its loop
    batch: int = 4
    learning_rate: float = 1e-3


PRESETS: dict[str, Config] = {
    "tiny": Config(),
    # a long-sequence layer: planning only (the interpreted kernel is slow at this size)
    "long": Config(hidden=1024, heads=16, seq_len=4096, block=512, batch=16),
}


# ---- the kernel --------------------------------------------------------------------------------------


def _flash_kernel(q_ref: Any, k_ref: Any, v_ref: Any, o_ref: Any, *, block: int) -> None:
    """One block of queries [block, d] against every key, ``block`` keys at a time (online softmax)."""
    q = q_ref[...] * (1.0 / math.sqrt(q_ref.shape[-1]))
    rows, d = q.shape

    def step(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        m, total, acc = carry
        k = k_ref[pl.ds(j * block, block), :]
        v = v_ref[pl.ds(j * block, block), :]
        s = q @ k.T
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        scale = jnp.exp(m - m_new)
        return m_new, total * scale + jnp.sum(p, axis=1), acc * scale[:, None] + p @ v

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    _, total, acc = jax.lax.fori_loop(0, k_ref.shape[0] // block, step, init)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


def _flash(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    b, h, s, d = q.shape
    rows = pl.BlockSpec((None, None, block, d), lambda i, j, t: (i, j, t, 0))
    whole = pl.BlockSpec((None, None, s, d), lambda i, j, t: (i, j, 0, 0))
    return pl.pallas_call(
        functools.partial(_flash_kernel, block=block),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, h, s // block),
        in_specs=[rows, whole, whole],
        out_specs=rows,
        interpret=True,  # runs on CPU; drop it on a GPU or TPU
        name="flash_attention",
    )(q, k, v)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Plain softmax attention on [batch, heads, seq, head_dim]: what the kernel computes."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> jax.Array:
    return _flash(q, k, v, block)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, block: int) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    return _flash(q, k, v, block), (q, k, v)


def _backward(block: int, saved: tuple[jax.Array, ...], g: jax.Array) -> tuple[jax.Array, ...]:
    return jax.vjp(attention, *saved)[1](g)  # recomputes attention: no kernel for the backward pass here


flash_attention.defvjp(_forward, _backward)

# The rule: q, k, v and the output are [batch, heads, seq, head_dim]; the kernel's work is independent
# over batch and heads, so those may be split; q·kᵀ and p·v are 2·b·h·q·k·d flops each.
autoshard.register_rule(
    "flash_attention",
    "b h q d, b h k d, b h k d -> b h q d",
    split=("b", "h"),
    flops=lambda ins, outs: 4.0 * math.prod(ins[0]) * ins[1][2],
)


# ---- the model ---------------------------------------------------------------------------------------


class Attention(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        b, s, _ = x.shape
        qkv = nn.Dense(3 * c.hidden, name="qkv")(x).reshape(b, s, 3, c.heads, c.hidden // c.heads)
        q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # [b, heads, s, head_dim]
        out = flash_attention(q, k, v, c.block).transpose(0, 2, 1, 3).reshape(b, s, c.hidden)
        return nn.Dense(c.hidden, name="out")(out)

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        return jnp.mean(jnp.square(self(batch["x"]) - batch["y"]))


def param_count(config: Config) -> int:
    h = config.hidden
    return h * 3 * h + 3 * h + h * h + h


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_fn(params: Any) -> jax.Array:
        return state.apply_fn({"params": params}, batch, method="loss")

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam: `b1 ** count`
        state = state.apply_gradients(grads=grads)
    return state, {"loss": loss}


def _build(config: Config, seed: int | jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    init_key, x_key, y_key = jax.random.split(jax.random.key(seed, impl="rbg"), 3)
    shape = (config.batch, config.seq_len, config.hidden)
    x = jax.random.normal(x_key, shape, jnp.float32)
    y = jax.random.normal(y_key, shape, jnp.float32)
    model = Attention(config)
    params = model.init(init_key, x)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(config.learning_rate))
    return state.replace(step=jnp.zeros((), jnp.int32)), {"x": x, "y": y}


def make(
    preset: str = "tiny", *, abstract: bool = False, seed: int = 0, **overrides: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    config = dataclasses.replace(PRESETS[preset], **overrides)
    if config.hidden % config.heads or config.seq_len % config.block:
        raise ValueError(f"flash_attention: heads must divide hidden and block must divide seq_len: {config}")
    if abstract:
        return jax.eval_shape(functools.partial(_build, config, seed))
    return jax.jit(_build, static_argnums=0)(config, seed)


if __name__ == "__main__":
    import argparse

    from autoshard.emit import global_rel_error

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if len(jax.devices()) < 8:
        raise SystemExit("this example plans on a 2x4 mesh: run it with "
                         "XLA_FLAGS=--xla_force_host_platform_device_count=8 on CPU")
    state, batch = make(args.preset)
    ref, par = jax.jit(train_step), autoshard.parallelize(train_step, mesh=(2, 4), time_budget_s=10)
    s_ref = s_par = state
    for i in range(args.steps):
        s_ref, m_ref = ref(s_ref, batch)
        s_par, m_par = par(s_par, batch)
        err = global_rel_error(m_ref["loss"], m_par["loss"])
        print(f"step {i + 1}: loss {float(m_par['loss']):.4f} (jax.jit {float(m_ref['loss']):.4f}, "
              f"relative error {err:.1e})")
    print(par.explain())
