"""A multi-layer perceptron: the smallest model file, and the one the golden sharding tests start from.

``layers`` dense layers (2 to 4) with an activation between them, trained with Adam on an MSE or a
classification loss. Two presets are the textbook cases of the two basic parallelisms:

- ``"wide"``: one dense→gelu→dense pair with a 16384-wide hidden layer and a small batch. The weights
  dwarf the activations, so the best plan is Megatron's tensor parallelism: split the first kernel by
  columns, the second by rows, and all-reduce once after the pair.
- ``"big-batch"``: a small model fed a large batch. The activations dwarf the weights, so the best plan is
  data parallelism: split the batch, replicate the weights, all-reduce the gradients.

Batch: ``{"x": float32 [batch, in_dim], "y": ...}`` where ``y`` is float32 ``[batch, out_dim]`` regression
targets for ``loss="mse"`` or int32 ``[batch]`` class labels for ``loss="xent"``.

Run one step: ``python examples/mlp.py --preset tiny``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    in_dim: int = 32
    hidden: int = 64
    out_dim: int = 8
    layers: int = 3  # dense layers in all, hidden ones included: 2 to 4
    activation: str = "relu"  # "relu" or "gelu"
    loss: str = "mse"  # "mse" (float targets) or "xent" (integer class labels, out_dim classes)
    batch: int = 16
    learning_rate: float = 1e-3
    dtype: str = "float32"  # compute dtype; parameters stay float32


PRESETS: dict[str, Config] = {
    "tiny": Config(),
    # dense_0 [1024, 16384] → gelu → dense_1 [16384, 1024]: the Megatron MLP pair (tensor parallel).
    "wide": Config(in_dim=1024, hidden=16384, out_dim=1024, layers=2, activation="gelu", batch=16),
    # A 4-layer, 512-wide classifier on a batch of 8192 (data parallel).
    "big-batch": Config(in_dim=256, hidden=512, out_dim=256, layers=4, loss="xent", batch=8192),
}

_ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu}


class MLP(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        if not 2 <= c.layers <= 4:
            raise ValueError(f"mlp: layers must be 2 to 4, got {c.layers}")
        if c.activation not in _ACTIVATIONS:
            raise ValueError(f"mlp: activation must be one of {sorted(_ACTIVATIONS)}, got {c.activation!r}")
        dtype = jnp.dtype(c.dtype)
        for i in range(c.layers - 1):
            x = nn.Dense(c.hidden, dtype=dtype, name=f"dense_{i}")(x)
            x = _ACTIVATIONS[c.activation](x)
        return nn.Dense(c.out_dim, dtype=dtype, name=f"dense_{c.layers - 1}")(x)

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        out = self(batch["x"]).astype(jnp.float32)
        if self.config.loss == "mse":
            return jnp.mean(jnp.square(out - batch["y"]))
        if self.config.loss == "xent":
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, batch["y"]))
        raise ValueError(f"mlp: loss must be 'mse' or 'xent', got {self.config.loss!r}")


def param_count(config: Config) -> int:
    """Kernels and biases of every dense layer."""
    dims = [config.in_dim] + [config.hidden] * (config.layers - 1) + [config.out_dim]
    return sum(a * b + b for a, b in itertools.pairwise(dims))


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_fn(params: Any) -> jax.Array:
        return state.apply_fn({"params": params}, batch, method="loss")

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    # optax's Adam computes `b1 ** count` (a Python float to an int32 power), which strict dtype
    # promotion rejects; the model above is strict-clean, only the update needs standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        state = state.apply_gradients(grads=grads)
    return state, {"loss": loss}


def _build(config: Config, seed: int | jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    # rbg (XLA's RngBitGenerator) compiles several times faster on CPU than the default threefry;
    # its numbers are deterministic for a given seed and backend.
    init_key, x_key, y_key = jax.random.split(jax.random.key(seed, impl="rbg"), 3)
    x = jax.random.normal(x_key, (config.batch, config.in_dim), jnp.float32)
    if config.loss == "xent":
        y = jax.random.randint(y_key, (config.batch,), 0, config.out_dim, jnp.int32)
    else:
        y = jax.random.normal(y_key, (config.batch, config.out_dim), jnp.float32)
    model = MLP(config)
    params = model.init(init_key, x)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(config.learning_rate))
    # TrainState.create starts `step` at Python's 0; an int32 array keeps every leaf an array.
    return state.replace(step=jnp.zeros((), jnp.int32)), {"x": x, "y": y}


def make(
    preset: str = "tiny", *, abstract: bool = False, seed: int = 0, **overrides: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    config = dataclasses.replace(PRESETS[preset], **overrides)
    if abstract:  # shapes and dtypes only: nothing is allocated
        return jax.eval_shape(functools.partial(_build, config, seed))
    return jax.jit(_build, static_argnums=0)(config, seed)  # one compiled init, not op by op


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    state, batch = make(args.preset)
    print(f"mlp {args.preset}: {param_count(PRESETS[args.preset]):,} parameters")
    step = jax.jit(train_step)
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        print(f"step {int(state.step)}: loss {float(metrics['loss']):.4f}")
