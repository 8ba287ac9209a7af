"""Llama: a decoder-only language model written the way published Flax Llamas are (Hugging Face's
``FlaxLlamaForCausalLM``, EasyLM).

    input_ids ─▶ embed_tokens ─▶ [layers/0 … layers/{L-1}] ─▶ norm ─▶ lm_head ─▶ logits
    layer: x = x + self_attn(input_layernorm(x)); x = x + mlp(post_attention_layernorm(x))
    self_attn: q [h, H·d], k, v [h, KV·d] (grouped-query: each key/value head serves H/KV query heads),
               RoPE on q and k, causal softmax(q·kᵀ/√d)·v under the padding mask, o_proj [H·d, h]
    mlp (SwiGLU): down_proj(silu(gate_proj(x)) · up_proj(x)), [h, ffn] [h, ffn] [ffn, h]

As in those models: RMSNorm written by hand (``x · rsqrt(mean(x²) + ε) · w``, the final ``norm`` too), no
biases, no dropout, an untied ``lm_head``, the layers a list of modules named ``"0"`` … inside a ``layers``
module (so every equation of layer 3 carries ``layers/3`` in its name stack), the RoPE tables computed once
before the layers and read by every one, and the batch's ``attention_mask`` read by every layer.

The mask: a token attends to the earlier tokens of its own segment, the real tokens (mask 1) or the padding
(mask 0). For every real token that is the usual key-padding mask; padding attends to padding, so that no row
of scores is empty. The loss counts the real tokens only, each row's mean weighing alike (``Llama.loss``).

With ``flash=True`` attention runs through jax's Pallas flash-attention kernel (the mask as its segment ids),
split over batch and heads by ``autoshard.splittable`` and priced by the rules ``examples/gpt.py`` registers,
as the GPT's ``flash`` is (interpreted on CPU: tiny shapes only there).

Presets: ``tiny`` for tests; ``7b`` (Llama-2 7B: d 4096, 32 layers, 32 heads and key/value heads, ffn 11008,
vocabulary 32000, sequence 4096, batch 64); ``70b`` (Llama-2 70B: d 8192, 80 layers, 64 heads, 8 key/value
heads, ffn 28672, batch 1024, the fused attention). Both large presets compute in bfloat16 (parameters and
optimizer state in float32). Batch: ``input_ids``, ``labels`` (the next token at each position) and
``attention_mask`` (rows right-padded to random lengths), int32 [batch, seq_len]. Optimiser: AdamW.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

import autoshard
from autoshard._examples import load_module

_gpt = load_module(Path(__file__).with_name("gpt.py"))  # registers the flash kernels' rules; _block_sizes


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    vocab: int = 256
    seq_len: int = 32
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    batch: int = 8
    dtype: str = "float32"  # compute dtype ("float32" or "bfloat16"); parameters stay float32
    flash: bool = False  # attention through jax's Pallas flash-attention kernel
    rope_theta: float = 10000.0
    eps: float = 1e-5
    learning_rate: float = 3e-4
    weight_decay: float = 0.1


PRESETS: dict[str, Config] = {
    "tiny": Config(learning_rate=1e-3),
    "7b": Config(vocab=32000, seq_len=4096, hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008,
                 batch=64, dtype="bfloat16"),
    "70b": Config(vocab=32000, seq_len=4096, hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672,
                  batch=1024, dtype="bfloat16", flash=True),
}

_INIT = nn.initializers.normal(stddev=0.02)


class RMSNorm(nn.Module):
    eps: float
    dtype: str

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        x = x.astype(jnp.float32)
        return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps) * w).astype(self.dtype)


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos and sin [seq, head_dim / 2] of the rotary embedding."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the halves of x [batch, seq, heads, head_dim] (the Hugging Face layout of the rotation)."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    cos, sin = cos[None, :, None], sin[None, :, None]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> jax.Array:
    """Causal attention of q, k, v [batch, seq, heads, head_dim] within each segment of segments [batch, seq],
    with full fp32 scores."""
    seq, head_dim = q.shape[1], q.shape[3]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) * head_dim**-0.5
    allowed = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None] & \
        (segments[:, None, :, None] == segments[:, None, None, :])
    scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bnqk,bknd->bqnd", probs, v)


def _mha(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array) -> jax.Array:
    """``attention`` through jax's Pallas kernel on one device's shard. The segments come as a float array
    (``splittable``'s operands are floating-point; their cotangent is zero)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    return pallas_attention.mha(q, k, v, segments.astype(jnp.int32), sm_scale=q.shape[3] ** -0.5, causal=True,
                                block_sizes=_gpt._block_sizes(q.shape[1], k.shape[1]),
                                interpret=jax.default_backend() != "gpu")


flash_attention = autoshard.splittable(_mha, "b q h d, b k h d, b k h d, b k -> b q h d", split=("b", "h"))


class Attention(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        c = self.config
        batch, seq, hidden = x.shape
        head_dim = hidden // c.heads
        dense = functools.partial(nn.Dense, use_bias=False, dtype=jnp.dtype(c.dtype), kernel_init=_INIT)
        q = dense(c.heads * head_dim, name="q_proj")(x).reshape(batch, seq, c.heads, head_dim)
        k = dense(c.kv_heads * head_dim, name="k_proj")(x).reshape(batch, seq, c.kv_heads, head_dim)
        v = dense(c.kv_heads * head_dim, name="v_proj")(x).reshape(batch, seq, c.kv_heads, head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = (jnp.repeat(t, c.heads // c.kv_heads, axis=2) for t in (k, v))  # each kv head to its group
        out = flash_attention(q, k, v, mask.astype(q.dtype)) if c.flash else attention(q, k, v, mask)
        return dense(hidden, name="o_proj")(out.reshape(batch, seq, c.heads * head_dim))


class MLP(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dense = functools.partial(nn.Dense, use_bias=False, dtype=jnp.dtype(c.dtype), kernel_init=_INIT)
        gate, up = dense(c.ffn, name="gate_proj")(x), dense(c.ffn, name="up_proj")(x)
        return dense(x.shape[-1], name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        c = self.config
        h = RMSNorm(c.eps, c.dtype, name="input_layernorm")(x)
        x = x + Attention(c, name="self_attn")(h, cos, sin, mask)
        return x + MLP(c, name="mlp")(RMSNorm(c.eps, c.dtype, name="post_attention_layernorm")(x))


class LayerCollection(nn.Module):
    """The layers as a list named "0" … "L-1" (Hugging Face's ``FlaxLlamaLayerCollection``)."""

    config: Config

    def setup(self) -> None:
        self.blocks = [DecoderLayer(self.config, name=str(i)) for i in range(self.config.layers)]

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array) -> jax.Array:
        for layer in self.blocks:
            x = layer(x, cos, sin, mask)
        return x


class Llama(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """int32 [batch, seq] tokens and mask → float32 [batch, seq, vocab] logits."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        x = nn.Embed(c.vocab, c.hidden, dtype=dtype, embedding_init=_INIT, name="embed_tokens")(input_ids)
        cos, sin = rope_tables(input_ids.shape[1], c.hidden // c.heads, c.rope_theta)
        x = LayerCollection(c, name="layers")(x, cos, sin, attention_mask)
        x = RMSNorm(c.eps, c.dtype, name="norm")(x)
        logits = nn.Dense(c.vocab, use_bias=False, dtype=dtype, kernel_init=_INIT, name="lm_head")(x)
        return logits.astype(jnp.float32)

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        """Next-token cross-entropy over each row's real (unpadded) tokens, averaged over the rows: every
        sequence weighs alike, so the loss of a batch is the mean of its microbatches' (a pipeline's
        accumulation is exact; dividing by the batch's token count would weigh microbatches by their tokens)."""
        logits = self(batch["input_ids"], batch["attention_mask"])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
        mask = batch["attention_mask"].astype(jnp.float32)
        return jnp.mean(jnp.sum(losses * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0))


def param_count(config: Config) -> int:
    """Exact: the embedding and the head (V·h each), per layer q and o (2·h·H·d), k and v (2·h·KV·d), the
    three MLP kernels (3·h·ffn) and two norms (2h), and the final norm (h)."""
    h, d = config.hidden, config.hidden // config.heads
    per_layer = 2 * h * config.heads * d + 2 * h * config.kv_heads * d + 3 * h * config.ffn + 2 * h
    return 2 * config.vocab * h + config.layers * per_layer + h


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_fn(params: Any) -> jax.Array:
        return state.apply_fn({"params": params}, batch, method="loss")

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    with jax.numpy_dtype_promotion("standard"):  # optax's `b1 ** count`, as in examples/gpt.py
        state = state.apply_gradients(grads=grads)
    return state, {"loss": loss}


def _build(config: Config, seed: int | jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    init_key, data_key, len_key = jax.random.split(jax.random.key(seed, impl="rbg"), 3)
    tokens = jax.random.randint(data_key, (config.batch, config.seq_len + 1), 0, config.vocab, jnp.int32)
    lengths = jax.random.randint(len_key, (config.batch, 1), config.seq_len // 2, config.seq_len + 1,
                                 jnp.int32)
    mask = (jnp.arange(config.seq_len, dtype=jnp.int32)[None] < lengths).astype(jnp.int32)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "attention_mask": mask}
    model = Llama(config)
    params = model.init(init_key, batch["input_ids"][:1], mask[:1])["params"]
    tx = optax.adamw(config.learning_rate, b1=0.9, b2=0.95, weight_decay=config.weight_decay)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return state.replace(step=jnp.zeros((), jnp.int32)), batch


def make(
    preset: str = "tiny", *, abstract: bool = False, seed: int = 0, **overrides: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    config = dataclasses.replace(PRESETS[preset], **overrides)
    if config.hidden % config.heads or config.heads % config.kv_heads or (config.hidden // config.heads) % 2:
        raise ValueError(f"llama: hidden ({config.hidden}) must be a multiple of heads ({config.heads}), heads "
                         f"of kv_heads ({config.kv_heads}), and the head size even (RoPE rotates pairs)")
    if abstract:  # shapes and dtypes only: nothing is allocated
        return jax.eval_shape(functools.partial(_build, config, seed))
    return jax.jit(_build, static_argnums=0)(config, seed)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    state, batch = make(args.preset)
    print(f"llama {args.preset}: {param_count(PRESETS[args.preset]):,} parameters")
    step = jax.jit(train_step)
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        print(f"step {int(state.step)}: loss {float(metrics['loss']):.4f}")
