"""A GShard-style mixture-of-experts language model (Lepikhin et al. 2020), with the shapes Alpa evaluated.

The model is gpt.py's pre-LN decoder with every ``moe_every``-th FFN replaced by a mixture of experts:
with the default ``moe_every=2``, blocks 1, 3, 5, … are MoE and blocks 0, 2, 4, … dense, as in GShard
and Alpa; ``moe_every=1`` makes every block MoE. Both kinds of FFN are ``ffn_mult``·h wide (8h, as in
Alpa's MoE benchmark).

An MoE FFN, in GShard's one-hot formulation (G groups of T tokens, E experts, capacity C slots each):

    tokens [B, S, h] → groups x [G, T, h]          (T = group_size tokens per group; G = B·S / T)
    gates = softmax(x · W_gate)                    [G, T, E]   (float32)
    top-2: each token picks its two best experts; a token takes the next free slot of an expert's
           buffer, first choices before second choices, and is dropped from an expert that is full:
           C = ceil(capacity_factor · 2 · T / E)
    dispatch [G, T, E, C] ∈ {0, 1};  combine = dispatch weighted by the (renormalised) top-2 gates
    expert_in  = einsum("gtec,gtd->egcd", dispatch, x)             [E, G, C, h]
    hidden     = gelu(einsum("egcd,edf->egcf", expert_in, fc) + fc_bias)      fc: [E, h, ffn]
    expert_out = einsum("egcf,efd->egcd", hidden, proj) + proj_bias          proj: [E, ffn, h]
    y          = einsum("gtec,egcd->gtd", combine, expert_out)     [G, T, h]

Every expert weight has a leading expert axis, so expert parallelism is sharding that axis (and the
dispatch/combine einsums become all-to-alls). The load-balancing loss (GShard eq. 4) is, per MoE layer,
E² · mean_e(fraction of tokens whose first choice is e · mean gate of e), 1 when balanced; the training
loss is the LM loss plus ``aux_loss_weight`` times its mean over MoE layers. GShard's random dispatch of
second choices is left out: routing is deterministic.

Presets: ``"tiny"`` and the GShard MoE rows of Alpa's Table 4 (Zheng et al. 2022): sequence 1024,
vocabulary 32000, batch 1024, 2048-token groups. The hidden sizes, layers and experts reproduce each
preset's name with Alpa's parameter-count formula; the head counts are from memory (they change no
parameter count). Batch: ``{"tokens": int32 [batch, seq_len + 1]}``. Optimiser: AdamW.
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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    vocab: int = 256
    seq_len: int = 32
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    ffn_mult: int = 8  # FFN width = ffn_mult · hidden, dense and expert alike
    experts: int = 4
    moe_every: int = 2  # blocks i with i % moe_every == moe_every - 1 are MoE
    group_size: int = 64  # tokens routed together; batch · seq_len must be a multiple
    capacity_factor: float = 1.0
    aux_loss_weight: float = 0.01
    batch: int = 8
    dtype: str = "float32"  # compute dtype; parameters and routing stay float32
    learning_rate: float = 1e-3


def _alpa(hidden: int, layers: int, heads: int, experts: int) -> Config:
    return Config(
        vocab=32000, seq_len=1024, hidden=hidden, layers=layers, heads=heads, experts=experts,
        group_size=2048, batch=1024, learning_rate=3e-4,
    )  # fmt: skip


PRESETS: dict[str, Config] = {
    "tiny": Config(),
    "380m": _alpa(768, 8, 16, 8),
    "690m": _alpa(768, 8, 16, 16),
    "1.3b": _alpa(768, 16, 16, 16),
    "2.4b": _alpa(1024, 16, 16, 16),
    "10b": _alpa(1536, 16, 16, 32),
    "27b": _alpa(2048, 16, 32, 48),
    "70b": _alpa(2048, 32, 32, 64),
}

_INIT = nn.initializers.normal(stddev=0.02)


def layer_norm(x: jax.Array, name: str) -> jax.Array:
    """LayerNorm in float32 (strict dtype promotion rejects flax mixing bfloat16 with float32 stats)."""
    return nn.LayerNorm(dtype=jnp.float32, name=name)(x.astype(jnp.float32))


class Attention(nn.Module):
    """Causal multi-head self-attention, as in gpt.py."""

    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        batch, seq, hidden = x.shape
        head_dim = hidden // c.heads
        qkv = nn.Dense(3 * hidden, dtype=dtype, kernel_init=_INIT, name="qkv")(x)
        q, k, v = (t.reshape(batch, seq, c.heads, head_dim) for t in jnp.split(qkv, 3, axis=-1))
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) * head_dim**-0.5
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        out = jnp.einsum("bnqk,bknd->bqnd", probs, v).reshape(batch, seq, hidden)
        return nn.Dense(hidden, dtype=dtype, kernel_init=_INIT, name="proj")(out)


class MLP(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        x = nn.Dense(c.ffn_mult * c.hidden, dtype=dtype, kernel_init=_INIT, name="fc")(x)
        return nn.Dense(c.hidden, dtype=dtype, kernel_init=_INIT, name="proj")(nn.gelu(x))


def top2_routing(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """float32 gates [G, T, E] → (dispatch [G, T, E, C], combine [G, T, E, C], load-balancing loss)."""
    experts = gates.shape[-1]
    index_1 = jnp.argmax(gates, axis=-1)
    mask_1 = jax.nn.one_hot(index_1, experts, dtype=jnp.int32)
    index_2 = jnp.argmax(jnp.where(mask_1 > 0, -jnp.inf, gates), axis=-1)
    mask_2 = jax.nn.one_hot(index_2, experts, dtype=jnp.int32)

    # Load balancing (GShard eq. 4): first-choice fraction per expert times its mean gate.
    fraction = jnp.mean(mask_1.astype(jnp.float32), axis=1)
    aux_loss = jnp.mean(fraction * jnp.mean(gates, axis=1)) * experts**2

    # Slot of each token in its expert's buffer (a running count over the group); first choices take
    # slots 0, 1, …; second choices queue behind all first choices kept by that expert.
    slot_1 = jnp.sum((jnp.cumsum(mask_1, axis=1) - 1) * mask_1, axis=-1)  # [G, T]
    kept_1 = jnp.minimum(jnp.sum(mask_1, axis=1, keepdims=True), capacity)  # [G, 1, E]
    slot_2 = jnp.sum((jnp.cumsum(mask_2, axis=1) - 1 + kept_1) * mask_2, axis=-1)

    gate_1 = jnp.sum(gates * mask_1.astype(jnp.float32), axis=-1)
    gate_2 = jnp.sum(gates * mask_2.astype(jnp.float32), axis=-1)
    norm = gate_1 + gate_2
    # one_hot of a slot >= capacity is all zeros: that is how a token overflowing an expert is dropped.
    route_1 = mask_1.astype(jnp.float32)[..., None] * jax.nn.one_hot(slot_1, capacity)[:, :, None, :]
    route_2 = mask_2.astype(jnp.float32)[..., None] * jax.nn.one_hot(slot_2, capacity)[:, :, None, :]
    dispatch = route_1 + route_2
    combine = (gate_1 / norm)[..., None, None] * route_1 + (gate_2 / norm)[..., None, None] * route_2
    return dispatch, combine, aux_loss


class MoE(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        batch, seq, hidden = x.shape
        tokens = batch * seq
        group = min(c.group_size, tokens)
        if tokens % group:
            raise ValueError(f"moe: batch·seq_len ({tokens}) must be a multiple of group_size ({group})")
        capacity = math.ceil(c.capacity_factor * 2 * group / c.experts)
        ffn = c.ffn_mult * hidden
        x = x.reshape(tokens // group, group, hidden)

        w_gate = self.param("gate", _INIT, (hidden, c.experts))
        gates = jax.nn.softmax(jnp.einsum("gtd,de->gte", x.astype(jnp.float32), w_gate), axis=-1)
        dispatch, combine, aux_loss = top2_routing(gates, capacity)

        fc = self.param("fc_kernel", _INIT, (c.experts, hidden, ffn)).astype(dtype)
        fc_bias = self.param("fc_bias", nn.initializers.zeros, (c.experts, ffn)).astype(dtype)
        proj = self.param("proj_kernel", _INIT, (c.experts, ffn, hidden)).astype(dtype)
        proj_bias = self.param("proj_bias", nn.initializers.zeros, (c.experts, hidden)).astype(dtype)

        expert_in = jnp.einsum("gtec,gtd->egcd", dispatch.astype(dtype), x.astype(dtype))
        h = nn.gelu(jnp.einsum("egcd,edf->egcf", expert_in, fc) + fc_bias[:, None, None, :])
        expert_out = jnp.einsum("egcf,efd->egcd", h, proj) + proj_bias[:, None, None, :]
        y = jnp.einsum("gtec,egcd->gtd", combine.astype(dtype), expert_out)
        return y.reshape(batch, seq, hidden), aux_loss


class Block(nn.Module):
    config: Config
    moe: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        x = x + Attention(self.config, name="attn")(layer_norm(x, "ln_1"))
        if not self.moe:
            return x + MLP(self.config, name="mlp")(layer_norm(x, "ln_2")), None
        y, aux_loss = MoE(self.config, name="moe")(layer_norm(x, "ln_2"))
        return x + y, aux_loss


class MoETransformer(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """int32 [batch, seq] → (float32 logits [batch, seq, vocab], mean load-balancing loss)."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        wte = nn.Embed(c.vocab, c.hidden, dtype=dtype, embedding_init=_INIT, name="wte")
        wpe = nn.Embed(c.seq_len, c.hidden, dtype=dtype, embedding_init=_INIT, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]
        aux_losses = []
        for i in range(c.layers):
            x, aux_loss = Block(c, moe=i % c.moe_every == c.moe_every - 1, name=f"block_{i}")(x)
            if aux_loss is not None:
                aux_losses.append(aux_loss)
        logits = wte.attend(layer_norm(x, "ln_f")).astype(jnp.float32)  # head tied to the embedding
        return logits, jnp.mean(jnp.stack(aux_losses)) if aux_losses else jnp.zeros((), jnp.float32)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        tokens = batch["tokens"]
        logits, aux_loss = self(tokens[:, :-1])
        lm_loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))
        return lm_loss + self.config.aux_loss_weight * aux_loss, {"lm_loss": lm_loss, "aux_loss": aux_loss}


def param_count(config: Config) -> int:
    """Exact parameter count (tied head). Per block: attention 4h² + 4h, two LayerNorms 4h, and an FFN
    of 2·f·h + f + h (f = ffn_mult·h) if dense, or E of them plus the gate h·E if MoE."""
    h, e = config.hidden, config.experts
    f = config.ffn_mult * h
    ffn = 2 * f * h + f + h
    moe_layers = config.layers // config.moe_every
    blocks = config.layers * (4 * h * h + 8 * h) + (config.layers - moe_layers) * ffn
    return (config.vocab + config.seq_len) * h + blocks + moe_layers * (e * ffn + h * e) + 2 * h


def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    def loss_fn(params: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        return state.apply_fn({"params": params}, batch, method="loss")

    (loss, parts), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    # optax's Adam computes `b1 ** count` (a Python float to an int32 power), which strict dtype
    # promotion rejects; the model above is strict-clean, only the update needs standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        state = state.apply_gradients(grads=grads)
    return state, {"loss": loss, **parts}


def _build(config: Config, seed: int | jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
    # rbg (XLA's RngBitGenerator) compiles several times faster on CPU than the default threefry;
    # its numbers are deterministic for a given seed and backend.
    init_key, data_key = jax.random.split(jax.random.key(seed, impl="rbg"))
    tokens = jax.random.randint(data_key, (config.batch, config.seq_len + 1), 0, config.vocab, jnp.int32)
    model = MoETransformer(config)
    params = model.init(init_key, tokens[:, :-1])["params"]
    tx = optax.adamw(config.learning_rate, b1=0.9, b2=0.98, weight_decay=0.01)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # TrainState.create starts `step` at Python's 0; an int32 array keeps every leaf an array.
    return state.replace(step=jnp.zeros((), jnp.int32)), {"tokens": tokens}


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
    print(f"moe {args.preset}: {param_count(PRESETS[args.preset]):,} parameters")
    step = jax.jit(train_step)
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        print(f"step {int(state.step)}: " + ", ".join(f"{k} {float(v):.4f}" for k, v in metrics.items()))
