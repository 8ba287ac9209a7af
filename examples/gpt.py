"""GPT: a decoder-only transformer language model, with the GPT-3 shapes that Alpa evaluated.

    tokens ─▶ wte + wpe ─▶ [block_0 … block_{L-1}] ─▶ ln_f ─▶ wteᵀ (tied head) ─▶ logits
    block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))       (pre-LN, as in GPT-2 and GPT-3)
    attn: qkv = x·W_qkv [h, 3h]; causal softmax(q·kᵀ/√d_head)·v per head; proj [h, h]
    mlp:  fc [h, 4h] → gelu → proj [4h, h]

The LM head is tied to the token embedding, as in GPT-2 and in Alpa's GPT (set ``tie_embeddings=False``
for a separate ``lm_head`` kernel [h, vocab] without bias). There is no dropout: a step is deterministic.

With ``scan_layers=True`` the blocks are one ``nn.scan`` named ``blocks`` whose parameters carry a leading
layer axis (``params["blocks"]["attn"]["qkv"]["kernel"]`` is [L, h, 3h]); otherwise they are separate
modules ``block_0`` … ``block_{L-1}``, and every traced equation's name stack carries its block's name.
``remat=True`` wraps each block in ``nn.remat`` (activations recomputed in the backward pass).

Attention materialises its fp32 scores [batch, heads, seq, seq], as attention written by hand does. With
``flash=True`` it runs through a fused kernel instead: jax's Pallas flash attention
(``jax.experimental.pallas.ops.gpu.attention.mha``: online softmax over blocks of keys, causal blocks
skipped, a fused backward), compiled by Triton on a GPU and interpreted elsewhere (slow: tiny shapes only on
CPU). Its forward and backward calls are ``autoshard.splittable`` over batch and heads (each device runs
the kernels on its shard), and its three kernels' flops are registered with ``autoshard.register_rule``
(on the matmul units), so the planner prices them as the GPU runs them; that is what a long sequence needs
(``--set flash=true --set seq_len=16384``). The backward call runs the forward kernel again for its row
statistics (jax's backward kernel alone is private API): 11 products a (query, key) pair where 9 would do.

With ``ring=True`` attention is ``autoshard.ring_attention``: the planner may split it along the sequence too,
as a zig-zag ring (context parallelism), with jnp reference blocks, or with ``flash=True`` the Pallas kernel
as the blocks (``mha`` with its log-sum-exps; the backward then runs jax's backward kernels on the saved
statistics: 9 products a pair in all, forward and backward, through its private ``_mha_backward`` where its
signature is the known one).

Presets: ``"tiny"`` for tests, and the GPT-3 family (Brown et al. 2020, Table 2.1) at Alpa's evaluation
settings (Zheng et al. 2022, Table 4): sequence 1024, vocabulary 51200, global batch 1024 sequences.
Reduce the batch for a concrete run, e.g. ``make("125m", batch=8)``.

Batch: ``{"tokens": int32 [batch, seq_len + 1]}``; the model reads ``tokens[:, :-1]`` and predicts
``tokens[:, 1:]``. Optimiser: AdamW (β₂ = 0.95, weight decay 0.1 on every parameter, as a simplification).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

import autoshard
from autoshard.ring import reference_block_backward


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    vocab: int = 256
    seq_len: int = 32
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    batch: int = 8
    dtype: str = "float32"  # compute dtype ("float32" or "bfloat16"); parameters stay float32
    scan_layers: bool = False
    remat: bool = False
    flash: bool = False  # attention through a fused kernel (jax's Pallas flash attention), see the docstring
    ring: bool = False  # attention that may also be split along the sequence (autoshard.ring_attention)
    tie_embeddings: bool = True
    learning_rate: float = 3e-4
    weight_decay: float = 0.1


def _gpt3(layers: int, hidden: int, heads: int) -> Config:
    return Config(vocab=51200, seq_len=1024, hidden=hidden, layers=layers, heads=heads, batch=1024)


PRESETS: dict[str, Config] = {
    "tiny": Config(learning_rate=1e-3),
    "125m": _gpt3(12, 768, 12),
    "350m": _gpt3(24, 1024, 16),
    "760m": _gpt3(24, 1536, 16),
    "1.3b": _gpt3(24, 2048, 32),
    "2.6b": _gpt3(32, 2560, 32),
    "6.7b": _gpt3(32, 4096, 32),
    "15b": _gpt3(48, 5120, 40),
    # Alpa's and Megatron's GPT-39B benchmark setting: batch 1024 x 1024 tokens, mixed precision (bf16 matmuls
    # and activations, fp32 parameters and optimizer state)
    "39b": dataclasses.replace(_gpt3(48, 8192, 64), dtype="bfloat16"),
    # Megatron-LM's GPT-1T (Narayanan et al. SC'21, Table 1: 128 layers, hidden 25600, 160 heads, sequence
    # 2048, batch 3072, mixed precision): the largest model of the paper, trained on 3072 A100s.
    "1t": dataclasses.replace(_gpt3(128, 25600, 160), seq_len=2048, batch=3072, dtype="bfloat16"),
}

_INIT = nn.initializers.normal(stddev=0.02)


def layer_norm(x: jax.Array, name: str) -> jax.Array:
    """LayerNorm computed in float32 whatever the compute dtype (flax's LayerNorm would otherwise mix
    bfloat16 inputs with float32 statistics, which strict dtype promotion rejects). Call it inside a
    compact method: the LayerNorm becomes a submodule of the caller."""
    return nn.LayerNorm(dtype=jnp.float32, name=name)(x.astype(jnp.float32))


class Attention(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        batch, seq, hidden = x.shape
        head_dim = hidden // c.heads
        qkv = nn.Dense(3 * hidden, dtype=dtype, kernel_init=_INIT, name="qkv")(x)
        # Megatron's layout: heads outermost, then (q, k, v) per head, so that splitting the kernel's
        # columns over devices gives each device whole heads and the split below stays local.
        q, k, v = jnp.split(qkv.reshape(batch, seq, c.heads, 3 * head_dim), 3, axis=-1)
        attend = (ring_flash_attention if c.flash else ring_attention) if c.ring else \
            (flash_attention if c.flash else attention)
        out = attend(q, k, v).reshape(batch, seq, hidden)
        return nn.Dense(hidden, dtype=dtype, kernel_init=_INIT, name="proj")(out)


def attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of q, k, v [batch, seq, heads, head_dim], with full fp32 scores. ``Attention`` looks
    the name up when it is called, so a script may swap it (``benchmarks/gpu_longseq.py``: cuDNN's kernel)."""
    seq, head_dim = q.shape[1], q.shape[3]
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) * head_dim**-0.5
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bnqk,bknd->bqnd", probs, v)


FLASH_BLOCK = 128  # rows of queries and of keys per kernel program (at most the sequence)


def _mha(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of one device's shard through jax's Pallas flash-attention kernel (``mha``)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    seq, head_dim = q.shape[1], q.shape[3]
    block = min(FLASH_BLOCK, seq)
    sizes = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block,
                                        block_q_dq=block, block_kv_dq=block)
    return pallas_attention.mha(q, k, v, None, sm_scale=head_dim**-0.5, causal=True, block_sizes=sizes,
                                interpret=jax.default_backend() != "gpu")


# Each device runs the kernels on its shard of the batch and heads (``autoshard.splittable``: XLA would
# otherwise gather a compiled kernel's operands and run it whole on every device). Its backward is mha's VJP
# on the shard, which runs the forward kernel again for its row statistics.
flash_attention = autoshard.splittable(_mha, "b q h d, b k h d, b k h d -> b q h d", split=("b", "h"))


def _mha_block(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> tuple[jax.Array, jax.Array]:
    """One block of a ring (``autoshard.ring``): ``mha`` on q [b, sq, h, d] over k, v [b, sk, h, d], with
    its rows' log-sum-exps (natural: ``mha``'s are in base 2)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    out, lse2 = pallas_attention.mha(q, k, v, None, sm_scale=q.shape[3] ** -0.5, causal=causal,
                                     block_sizes=_block_sizes(q.shape[1], k.shape[1]), return_residuals=True,
                                     interpret=jax.default_backend() != "gpu")
    return out, lse2 * math.log(2.0)  # the kernel's log-sum-exp is in base 2


def _mha_block_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, lse: jax.Array,
                        dout: jax.Array, causal: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block's gradients from jax's backward kernels, given the rows' global ``out`` and ``lse`` (what
    ``mha``'s own VJP runs after its forward: ``_mha_backward`` is private API, so a jax without it gets the
    jnp reference, which materialises the block's scores)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    kernel = getattr(pallas_attention, "_mha_backward", None)
    if kernel is None or list(inspect.signature(kernel).parameters) != _MHA_BACKWARD:
        return reference_block_backward(q, k, v, out, lse, dout, causal)
    return tuple(kernel(q.shape[3] ** -0.5, causal, _block_sizes(q.shape[1], k.shape[1]), "triton", None, 2, None,
                        jax.default_backend() != "gpu", False, False, (q, k, v, None, out, lse * math.log2(math.e)),
                        dout)[:3])


_MHA_BACKWARD = ["sm_scale", "causal", "block_sizes", "backward_pass_impl", "num_warps", "num_stages", "grid",
                 "interpret", "debug", "return_residuals", "res", "do"]


def _block_sizes(sq: int, sk: int) -> Any:
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    bq, bk = min(FLASH_BLOCK, sq), min(FLASH_BLOCK, sk)
    return pallas_attention.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bq, block_kv_dkv=bk, block_q_dq=bq,
                                       block_kv_dq=bk)


# Attention the planner may also split along the sequence, as a zig-zag ring (context parallelism): with the
# flash kernels as its blocks (``ring=true flash=true``), or the jnp reference blocks (``ring=true``).
ring_flash_attention = autoshard.ring_attention(_mha_block, _mha_block_backward)
ring_attention = autoshard.ring_attention()


def _causal_pairs(q: tuple[int, ...], k: tuple[int, ...]) -> float:
    """(query, key) pairs a causal kernel computes per batch row and head, with blocks of ``FLASH_BLOCK``:
    the blocks on and below the diagonal."""
    block = min(FLASH_BLOCK, q[1])
    return q[1] * k[1] * (1 + block / q[1]) / 2


# What the kernels inside cost, for the planner: [batch, seq, heads, head_dim] operands and results, row
# statistics [batch, heads, seq]. The forward makes two products a (query, key) pair (q·kᵀ, p·v), the
# backward seven (dk and dv: q·kᵀ, pᵀ·dO, dO·vᵀ, dsᵀ·q; dq: q·kᵀ, dO·vᵀ, ds·k), each 2·head_dim flops.
autoshard.register_rule(
    "mha_forward", "b q h d, b k h d, b k h d -> b q h d, b h q", split=("b", "h"), matmul=True,
    flops=lambda ins, outs: 2 * 2 * ins[0][0] * ins[0][2] * ins[0][3] * _causal_pairs(ins[0], ins[1]))
autoshard.register_rule(
    "mha_preprocess_backward", "b q h d, b q h d -> b h q", split=("b", "h"),
    flops=lambda ins, outs: 2.0 * math.prod(ins[0]))
autoshard.register_rule(
    "mha_backward", "b q h d, b k h d, b k h d, b q h d, b q h d, b h q, b h q -> b q h d, b k h d, b k h d",
    split=("b", "h"), matmul=True,
    flops=lambda ins, outs: 7 * 2 * ins[0][0] * ins[0][2] * ins[0][3] * _causal_pairs(ins[0], ins[1]))


class MLP(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = jnp.dtype(self.config.dtype)
        hidden = x.shape[-1]
        x = nn.Dense(4 * hidden, dtype=dtype, kernel_init=_INIT, name="fc")(x)
        return nn.Dense(hidden, dtype=dtype, kernel_init=_INIT, name="proj")(nn.gelu(x))


class Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        # (carry, per-layer input) -> (carry, per-layer output): the signature nn.scan wants.
        x = x + Attention(self.config, name="attn")(layer_norm(x, "ln_1"))
        x = x + MLP(self.config, name="mlp")(layer_norm(x, "ln_2"))
        return x, None


class GPT(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """int32 [batch, seq] tokens → float32 [batch, seq, vocab] logits."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        wte = nn.Embed(c.vocab, c.hidden, dtype=dtype, embedding_init=_INIT, name="wte")
        wpe = nn.Embed(c.seq_len, c.hidden, dtype=dtype, embedding_init=_INIT, name="wpe")
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None]

        block = nn.remat(Block, prevent_cse=not c.scan_layers) if c.remat else Block
        if c.scan_layers:
            stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=c.layers)
            x, _ = stack(c, name="blocks")(x, None)
        else:
            for i in range(c.layers):
                x, _ = block(c, name=f"block_{i}")(x)

        x = layer_norm(x, "ln_f")
        if c.tie_embeddings:
            logits = wte.attend(x)
        else:
            logits = nn.Dense(c.vocab, use_bias=False, dtype=dtype, kernel_init=_INIT, name="lm_head")(x)
        return logits.astype(jnp.float32)

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        """Mean next-token cross-entropy."""
        tokens = batch["tokens"]
        logits = self(tokens[:, :-1])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


def param_count(config: Config) -> int:
    """Exact parameter count: embeddings, 12h² + 13h per block, the final LayerNorm, the head if untied.

    Per block: qkv 3h² + 3h, attention proj h² + h, fc 4h² + 4h, mlp proj 4h² + h, two LayerNorms 4h.
    """
    h = config.hidden
    head = 0 if config.tie_embeddings else config.vocab * h
    return (config.vocab + config.seq_len) * h + config.layers * (12 * h * h + 13 * h) + 2 * h + head


def forward_flops(config: Config) -> float:
    """Matrix-multiply flops of one forward pass (2 per multiply-add; the dot_generals of the trace).

    With B = batch, S = seq_len, h = hidden, L = layers, V = vocab:

        2·B·S·(12·L·h² + V·h)   the dense layers (qkv, proj, fc, proj) and the LM head
      + 4·B·S²·h·L              attention scores q·kᵀ and probs·v, full S×S (the causal mask is
                                applied after the matmul, so the masked half is still computed)

    The embedding lookup is a gather, not a matmul; biases, norms, softmax and GELU are left out.
    """
    b, s, h, n, v = config.batch, config.seq_len, config.hidden, config.layers, config.vocab
    return 2.0 * b * s * (12 * n * h * h + v * h) + 4.0 * b * s * s * h * n


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
    init_key, data_key = jax.random.split(jax.random.key(seed, impl="rbg"))
    tokens = jax.random.randint(data_key, (config.batch, config.seq_len + 1), 0, config.vocab, jnp.int32)
    model = GPT(config)
    params = model.init(init_key, tokens[:1, :-1])["params"]
    tx = optax.adamw(config.learning_rate, b1=0.9, b2=0.95, weight_decay=config.weight_decay)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    # TrainState.create starts `step` at Python's 0; an int32 array keeps every leaf an array.
    return state.replace(step=jnp.zeros((), jnp.int32)), {"tokens": tokens}


def make(
    preset: str = "tiny", *, abstract: bool = False, seed: int = 0, **overrides: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    config = dataclasses.replace(PRESETS[preset], **overrides)
    if config.hidden % config.heads:
        raise ValueError(f"gpt: hidden ({config.hidden}) must be a multiple of heads ({config.heads})")
    if abstract:  # shapes and dtypes only: nothing is allocated
        return jax.eval_shape(functools.partial(_build, config, seed))
    return jax.jit(_build, static_argnums=0)(config, seed)  # one compiled init, not op by op


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=list(PRESETS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpoint", metavar="DIR", help="run under autoshard.parallelize, save the state "
                        "under DIR after every step and, when DIR holds one, resume from its newest step")
    args = parser.parse_args()
    state, batch = make(args.preset)
    print(f"gpt {args.preset}: {param_count(PRESETS[args.preset]):,} parameters")
    if args.checkpoint:  # a job that can stop and resume, on whatever devices it then finds
        step = autoshard.parallelize(train_step)
        if autoshard.checkpoint.latest_step(args.checkpoint) is not None:
            state = step.restore(args.checkpoint, like=state, args=(state, batch))  # in this plan's layout
            print(f"resumed from step {int(state.step)}")
    else:
        step = jax.jit(train_step)
    for _ in range(args.steps):
        state, metrics = step(state, batch)
        print(f"step {int(state.step)}: loss {float(metrics['loss']):.4f}")
        if args.checkpoint:
            step.save(args.checkpoint, state, int(state.step), keep=3)
