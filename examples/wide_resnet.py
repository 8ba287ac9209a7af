"""Wide-ResNet: the bottleneck ResNet family that Alpa evaluated, an image classifier built of convolutions.

    image [B, H, W, 3] ─▶ stem: conv 7×7/2, norm, relu, max-pool 3×3/2
      ─▶ 4 stages of bottleneck blocks; stage i has F·2ⁱ filters and strides by 2 on entry (i > 0)
      ─▶ global average pool ─▶ dense head [4·F·8, classes]
    block(x) = relu(shortcut(x) + norm(conv 1×1 → 4f (relu(norm(conv 3×3 → f·w (relu(norm(conv 1×1 → f (x)))))))))

The width factor w widens only the 3×3 convolution (f → f·w channels), as in Alpa's model; with Alpa's
settings this reproduces each preset's parameter count in its name (see ``param_count``). The shortcut is
a 1×1 projection (with its norm) wherever the shape changes.

Normalisation is GroupNorm (``norm_groups`` groups, fewer where the channels are not a multiple), not the
BatchNorm of the original: BatchNorm's running statistics would add a mutable ``batch_stats`` collection to
the train state and tie samples of a batch together; GroupNorm normalises each sample on its own, keeps
the state to params and optimiser state, and has the same parameters (a scale and a bias per channel).
Norms are computed in float32.

Presets: ``"tiny"`` (32×32 images) and ``"small"`` for tests, and the Wide-ResNet rows of Alpa's Table 4
(Zheng et al. 2022): 224×224 images, 1024 classes, batch 1536. The layer counts, base filters and width
factors reproduce each name's parameter count; the batch size and class count are from memory of Alpa's
benchmark suite. Batch: ``{"x": float32 [batch, image, image, 3], "y": int32 [batch]}``.
Optimiser: SGD with momentum 0.9.
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

STAGES = {14: (1, 1, 1, 1), 26: (2, 2, 2, 2), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    image_size: int = 32
    layers: int = 14  # a key of STAGES: 3 convolutions per block, plus the stem and the head
    filters: int = 8  # F: the first stage's bottleneck width
    width_factor: int = 2  # w: widens the 3×3 convolutions
    classes: int = 10
    norm_groups: int = 32
    batch: int = 8
    dtype: str = "float32"  # compute dtype; parameters and norms stay float32
    learning_rate: float = 0.1


def _alpa(layers: int, filters: int, width_factor: int) -> Config:
    return Config(
        image_size=224, layers=layers, filters=filters, width_factor=width_factor, classes=1024, batch=1536
    )


PRESETS: dict[str, Config] = {
    "tiny": Config(),
    "small": Config(image_size=64, layers=26, filters=16, classes=100, batch=32),
    "250m": _alpa(50, 160, 2),
    "1b": _alpa(50, 320, 2),
    "2b": _alpa(50, 448, 2),
    "4b": _alpa(50, 640, 2),
    "6.8b": _alpa(50, 320, 16),
    "13b": _alpa(101, 320, 16),
}


def group_norm(x: jax.Array, groups: int, name: str, zero_scale: bool = False) -> jax.Array:
    """GroupNorm in float32, with the largest group count <= ``groups`` that divides the channels."""
    scale_init = nn.initializers.zeros if zero_scale else nn.initializers.ones
    groups = math.gcd(x.shape[-1], groups)
    return nn.GroupNorm(groups, dtype=jnp.float32, scale_init=scale_init, name=name)(x.astype(jnp.float32))


class Bottleneck(nn.Module):
    config: Config
    filters: int
    strides: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        conv = functools.partial(nn.Conv, use_bias=False, dtype=jnp.dtype(c.dtype))
        norm = functools.partial(group_norm, groups=c.norm_groups)
        f, s = self.filters, (self.strides, self.strides)
        y = nn.relu(norm(conv(f, (1, 1), name="conv_1")(x), name="norm_1"))
        y = nn.relu(norm(conv(f * c.width_factor, (3, 3), s, name="conv_2")(y), name="norm_2"))
        # A zero-initialised last scale makes every block start as the identity (Goyal et al. 2017).
        y = norm(conv(4 * f, (1, 1), name="conv_3")(y), name="norm_3", zero_scale=True)
        if x.shape != y.shape:
            x = norm(conv(4 * f, (1, 1), s, name="conv_proj")(x), name="norm_proj")
        return nn.relu(x + y).astype(jnp.dtype(c.dtype))


class WideResNet(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        """float32 [batch, H, W, 3] images → float32 [batch, classes] logits."""
        c = self.config
        if c.layers not in STAGES:
            raise ValueError(f"wide_resnet: layers must be one of {sorted(STAGES)}, got {c.layers}")
        dtype = jnp.dtype(c.dtype)
        x = nn.Conv(c.filters, (7, 7), (2, 2), use_bias=False, dtype=dtype, name="conv_init")(images)
        x = nn.relu(group_norm(x, c.norm_groups, name="norm_init")).astype(dtype)
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, blocks in enumerate(STAGES[c.layers]):
            for j in range(blocks):
                strides = 2 if i > 0 and j == 0 else 1
                x = Bottleneck(c, c.filters * 2**i, strides, name=f"stage_{i}_block_{j}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(c.classes, dtype=dtype, name="head")(x).astype(jnp.float32)

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        logits = self(batch["x"])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]))


def param_count(config: Config) -> int:
    """Exact parameter count: bias-free convolutions, a scale and a bias per normalised channel, the head.

    A block with input channels i and filters f holds i·f + 9·f·(f·w) + (f·w)·4f conv weights and
    2·(f + f·w + 4f) norm parameters, plus i·4f + 2·4f for a projection shortcut when i ≠ 4f (the first block of a stage).
    """
    f0, w = config.filters, config.width_factor
    total = 49 * 3 * f0 + 2 * f0
    channels = f0
    for i, blocks in enumerate(STAGES[config.layers]):
        f = f0 * 2**i
        for _ in range(blocks):
            total += channels * f + 9 * f * f * w + f * w * 4 * f + 2 * (f + f * w + 4 * f)
            if channels != 4 * f:  # the first block of each stage: a projection shortcut
                total += channels * 4 * f + 2 * 4 * f
            channels = 4 * f
    return total + channels * config.classes + config.classes


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_fn(params: Any) -> jax.Array:
        return state.apply_fn({"params": params}, batch, method="loss")

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}  # optax.sgd is strict-promotion clean


def _build(config: Config, seed: int | jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    # rbg (XLA's RngBitGenerator) compiles several times faster on CPU than the default threefry;
    # its numbers are deterministic for a given seed and backend.
    init_key, x_key, y_key = jax.random.split(jax.random.key(seed, impl="rbg"), 3)
    x = jax.random.normal(x_key, (config.batch, config.image_size, config.image_size, 3), jnp.float32)
    y = jax.random.randint(y_key, (config.batch,), 0, config.classes, jnp.int32)
    model = WideResNet(config)
    params = model.init(init_key, x[:1])["params"]
    tx = optax.sgd(config.learning_rate, momentum=0.9)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
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
    print(f"wide_resnet {args.preset}: {param_count(PRESETS[args.preset]):,} parameters")
    step = jax.jit(train_step)
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        print(f"step {int(state.step)}: loss {float(metrics['loss']):.4f}")
