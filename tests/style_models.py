"""The example GPT written in the styles models are written in, as model-file-like objects (``PRESETS``,
``make``, ``train_step``, the ``examples/`` convention), for tests of what autoshard reads from a model's
structure whatever its layers are called.

``STYLES``: the same computation with the same parameters as ``examples/gpt.py`` (any of its presets), its
blocks named six ways:

- ``example``: ``examples/gpt.py`` itself: ``block_0`` … ``block_{L-1}``;
- ``numbered``: a list of modules named ``"0"`` … inside a ``h`` module (``h/0``: Hugging Face's Flax
  models); its blocks are the example's, so their layer norms are still ``ln_1`` and ``ln_2``;
- ``flax_default``: ``Block(config)(x)`` in a loop without names: flax calls them ``Block_0``, ``Block_1``;
- ``nnx_list``: flax nnx, the blocks an ``nnx.List`` attribute; nnx puts no names on the equations at all.
  Its state is ``NnxState`` (the split ``(model, optimizer)`` with its graphdef as static data) and its step
  is the functional form: merge, ``optimizer.update(model, grads)``, split;
- ``scan``: ``nn.scan`` over the blocks (the example's ``scan_layers=True``: one scan op named ``blocks``);
- ``unnumbered``: ``self.first = Block(); self.second = Block(); …`` (ordinal words, no digit anywhere).

Every style's parameters are the example's, laid out as that style lays them out (``make`` builds the
example's state from the seed and rearranges it), so at the same seed every style starts from the same
numbers and its losses should follow the example's.

``OTHERS``: models of other shapes, each with a ``tiny`` preset: ``gpt2`` (Hugging Face's GPT-2 names:
``h/0/ln_1``, ``attn/c_attn``, ``mlp/c_fc``, Conv1D kernels stored [out, in] and read transposed, tied
embeddings; 4 layers), ``encoder_decoder`` (2 encoder and 2 decoder blocks, each decoder block's
cross-attention reading the encoder's output; flax's WMT example's names ``encoder/encoderblock_0``,
``decoder/encoderdecoderblock_0``) and ``alternating`` (4 blocks ``block_0`` …: even blocks a dense MLP
[h, 4h], odd blocks a soft mixture of two experts [h, 2h] under a learned gate).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training.train_state import TrainState

from autoshard._examples import load_module

gpt = load_module(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")
Config = gpt.Config


@dataclasses.dataclass(frozen=True, eq=False)
class Style:
    """A model file as an object: ``make(preset, *, abstract, seed, **overrides) -> (state, batch)`` and
    ``train_step(state, batch) -> (state, metrics)``."""

    name: str
    PRESETS: dict[str, Config]
    build: Callable[[Config, Any], tuple[Any, dict[str, jax.Array]]] = dataclasses.field(repr=False)
    train_step: Callable[..., Any] = dataclasses.field(repr=False)

    def make(self, preset: str = "tiny", *, abstract: bool = False, seed: int = 0,
             **overrides: Any) -> tuple[Any, dict[str, jax.Array]]:
        config = dataclasses.replace(self.PRESETS[preset], **overrides)
        if abstract:
            return jax.eval_shape(functools.partial(self.build, config, seed))
        return jax.jit(self.build, static_argnums=0)(config, seed)


def _adamw(c: Config) -> optax.GradientTransformation:
    return optax.adamw(c.learning_rate, b1=0.9, b2=0.95, weight_decay=c.weight_decay)


def _linen(model: type[nn.Module], arrange: Callable[[dict, Config], dict]) -> Callable[..., Any]:
    """A build for a linen model: the example's parameters from the seed, rearranged by ``arrange`` (checked
    against the model's own init: the same tree, shapes and dtypes), and the example's batch."""

    def build(c: Config, seed: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        example, batch = gpt._build(dataclasses.replace(c, scan_layers=False), seed)
        params = arrange(dict(example.params), c)
        m = model(c)
        want = jax.eval_shape(m.init, jax.random.key(0), batch["tokens"][:1, :-1])["params"]
        assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == \
            jax.tree.map(lambda x: (x.shape, x.dtype), want), f"{model.__name__}: the rearranged parameters"
        state = TrainState.create(apply_fn=m.apply, params=params, tx=_adamw(c))
        return state.replace(step=jnp.zeros((), jnp.int32)), batch

    return build


def _blocks(params: dict, c: Config) -> tuple[dict, list[Any]]:
    return params, [params.pop(f"block_{i}") for i in range(c.layers)]


class Stack(nn.Module):
    """The blocks as a list of modules named "0", "1", … (Hugging Face's ``FlaxGPT2BlockCollection``)."""

    config: Config

    def setup(self) -> None:
        self.blocks = [gpt.Block(self.config, name=str(i)) for i in range(self.config.layers)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x, _ = block(x)
        return x


class _Body(gpt.GPT):
    """The example's GPT with its loop of blocks replaced by the class's entry in ``STACKS`` (embeddings,
    final norm, tied head and loss as the example's). A function, not a method: flax would put a method's
    name on the name stack (``Numbered.stack/h/0``), which no published model has."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        wte = nn.Embed(c.vocab, c.hidden, dtype=dtype, embedding_init=gpt._INIT, name="wte")
        wpe = nn.Embed(c.seq_len, c.hidden, dtype=dtype, embedding_init=gpt._INIT, name="wpe")
        x = STACKS[type(self).__name__](c, wte(tokens) + wpe(jnp.arange(tokens.shape[1]))[None])
        return wte.attend(gpt.layer_norm(x, "ln_f")).astype(jnp.float32)


class Numbered(_Body):
    pass


def _numbered_stack(c: Config, x: jax.Array) -> jax.Array:
    return Stack(c, name="h")(x)


def _numbered(params: dict, c: Config) -> dict:
    params, blocks = _blocks(params, c)
    return {**params, "h": {str(i): b for i, b in enumerate(blocks)}}


class FlaxDefault(_Body):
    pass


def _flax_default_stack(c: Config, x: jax.Array) -> jax.Array:
    for _ in range(c.layers):
        x, _ = gpt.Block(c)(x)  # no name: flax calls it Block_{i}
    return x


def _flax_default(params: dict, c: Config) -> dict:
    params, blocks = _blocks(params, c)
    return {**params, **{f"Block_{i}": b for i, b in enumerate(blocks)}}


_UNITS = "first second third fourth fifth sixth seventh eighth ninth".split()
_TEENS = ("tenth eleventh twelfth thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth "
          "nineteenth").split()
_TENS = {2: "twenty", 3: "thirty", 4: "forty", 5: "fifty", 6: "sixty", 7: "seventy", 8: "eighty", 9: "ninety"}


def ordinal(n: int) -> str:
    """1 -> "first", 24 -> "twenty_fourth", 40 -> "fortieth" (1 to 99): a name with no digit in it."""
    if n < 10:
        return _UNITS[n - 1]
    if n < 20:
        return _TEENS[n - 10]
    tens, units = divmod(n, 10)
    return _TENS[tens][:-1] + "ieth" if units == 0 else f"{_TENS[tens]}_{_UNITS[units - 1]}"


class UnnumberedStack(nn.Module):
    """``self.first = Block(); self.second = Block(); …``, as many as the config has layers."""

    config: Config

    def setup(self) -> None:
        for i in range(self.config.layers):
            setattr(self, ordinal(i + 1), gpt.Block(self.config))

    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.config.layers):
            x, _ = getattr(self, ordinal(i + 1))(x)
        return x


class Unnumbered(_Body):
    pass


def _unnumbered_stack(c: Config, x: jax.Array) -> jax.Array:
    return UnnumberedStack(c, name="blocks")(x)


def _unnumbered(params: dict, c: Config) -> dict:
    params, blocks = _blocks(params, c)
    return {**params, "blocks": {ordinal(i + 1): b for i, b in enumerate(blocks)}}


def _scanned(params: dict, c: Config) -> dict:
    params, blocks = _blocks(params, c)
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)}


def _scan_build(c: Config, seed: Any) -> tuple[TrainState, dict[str, jax.Array]]:
    return _linen(gpt.GPT, _scanned)(dataclasses.replace(c, scan_layers=True), seed)


# ---- flax nnx: the blocks an nnx.List ------------------------------------------------------------------


def _ln(hidden: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(hidden, epsilon=1e-6, dtype=jnp.float32, rngs=rngs)


def _linear(n_in: int, n_out: int, c: Config, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(n_in, n_out, dtype=jnp.dtype(c.dtype), kernel_init=gpt._INIT, rngs=rngs)


class NnxBlock(nnx.Module):
    """``gpt.Block`` in nnx: the same products in the same order."""

    def __init__(self, c: Config, rngs: nnx.Rngs) -> None:
        h = c.hidden
        self.heads = c.heads
        self.ln_1, self.ln_2 = _ln(h, rngs), _ln(h, rngs)
        self.qkv, self.proj = _linear(h, 3 * h, c, rngs), _linear(h, h, c, rngs)
        self.fc, self.fc_proj = _linear(h, 4 * h, c, rngs), _linear(4 * h, h, c, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, seq, hidden = x.shape
        qkv = self.qkv(self.ln_1(x.astype(jnp.float32)))
        q, k, v = jnp.split(qkv.reshape(batch, seq, self.heads, 3 * hidden // self.heads), 3, axis=-1)
        x = x + self.proj(gpt.attention(q, k, v).reshape(batch, seq, hidden))
        return x + self.fc_proj(nnx.gelu(self.fc(self.ln_2(x.astype(jnp.float32)))))


class NnxGPT(nnx.Module):
    def __init__(self, c: Config, rngs: nnx.Rngs) -> None:
        dtype = jnp.dtype(c.dtype)
        self.wte = nnx.Embed(c.vocab, c.hidden, dtype=dtype, embedding_init=gpt._INIT, rngs=rngs)
        self.wpe = nnx.Embed(c.seq_len, c.hidden, dtype=dtype, embedding_init=gpt._INIT, rngs=rngs)
        self.blocks = getattr(nnx, "List", list)([NnxBlock(c, rngs) for _ in range(c.layers)])
        self.ln_f = _ln(c.hidden, rngs)

    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        tokens = batch["tokens"]
        x = self.wte(tokens[:, :-1]) + self.wpe(jnp.arange(tokens.shape[1] - 1))[None]
        for block in self.blocks:
            x = block(x)
        logits = self.wte.attend(self.ln_f(x.astype(jnp.float32))).astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


@flax.struct.dataclass
class NnxState:
    """The functional form of ``(model, optimizer)``: its state, and its graphdef as static data (so that the
    step, a plain function of pytrees, can merge them again)."""

    graphdef: Any = flax.struct.field(pytree_node=False)
    state: Any


def _nnx_params(example: dict, c: Config) -> dict:
    """The example's parameters under NnxGPT's names."""
    def block(b: dict) -> dict:
        return {"ln_1": b["ln_1"], "ln_2": b["ln_2"], "qkv": b["attn"]["qkv"], "proj": b["attn"]["proj"],
                "fc": b["mlp"]["fc"], "fc_proj": b["mlp"]["proj"]}

    return {"wte": example["wte"], "wpe": example["wpe"], "ln_f": example["ln_f"],
            "blocks": {i: block(example[f"block_{i}"]) for i in range(c.layers)}}


def _nnx_build(c: Config, seed: Any) -> tuple[NnxState, dict[str, jax.Array]]:
    example, batch = gpt._build(dataclasses.replace(c, scan_layers=False), seed)
    model = NnxGPT(c, nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    mapped = _nnx_params(dict(example.params), c)
    flat = {path: leaf for path, leaf in _leaves(mapped)}
    if hasattr(nnx, "to_pure_dict"):  # flax >= 0.11; State's own methods before
        own, _ = dict(_leaves(nnx.to_pure_dict(params))), nnx.replace_by_pure_dict(params, mapped)
    else:
        own, _ = dict(_leaves(params.to_pure_dict())), params.replace_by_pure_dict(mapped)
    assert {p: (x.shape, x.dtype) for p, x in own.items()} == {p: (x.shape, x.dtype) for p, x in flat.items()}
    nnx.update(model, params)
    optimizer = nnx.Optimizer(model, _adamw(c), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    return NnxState(graphdef, state), batch


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def nnx_train_step(state: NnxState, batch: dict[str, jax.Array]) -> tuple[NnxState, dict[str, jax.Array]]:
    model, optimizer = nnx.merge(state.graphdef, state.state)
    loss, grads = nnx.value_and_grad(lambda m: m.loss(batch))(model)
    with jax.numpy_dtype_promotion("standard"):  # optax's `b1 ** count`
        optimizer.update(model, grads)
    return state.replace(state=nnx.state((model, optimizer))), {"loss": loss}


STYLES: dict[str, Style] = {
    "example": Style("example", gpt.PRESETS, gpt._build, gpt.train_step),
    "numbered": Style("numbered", gpt.PRESETS, _linen(Numbered, _numbered), gpt.train_step),
    "flax_default": Style("flax_default", gpt.PRESETS, _linen(FlaxDefault, _flax_default), gpt.train_step),
    "nnx_list": Style("nnx_list", gpt.PRESETS, _nnx_build, nnx_train_step),
    "scan": Style("scan", gpt.PRESETS, _scan_build, gpt.train_step),
    "unnumbered": Style("unnumbered", gpt.PRESETS, _linen(Unnumbered, _unnumbered), gpt.train_step),
}


# ---- GPT-2 as Hugging Face writes it ------------------------------------------------------------------


class Conv1D(nn.Module):
    """Hugging Face's ``FlaxConv1D``: a kernel stored [out, in] and read transposed."""

    features: int
    dtype: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param("kernel", gpt._INIT, (self.features, x.shape[-1]))
        bias = self.param("bias", nn.initializers.zeros, (self.features,))
        y = jax.lax.dot_general(x, kernel.T.astype(self.dtype), (((x.ndim - 1,), (0,)), ((), ())))
        return y + bias.astype(self.dtype)


class GPT2Block(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        batch, seq, hidden = x.shape
        h = gpt.layer_norm(x, "ln_1")
        with_heads = functools.partial(jnp.reshape, shape=(batch, seq, c.heads, hidden // c.heads))
        q, k, v = (with_heads(t) for t in jnp.split(Conv1D(3 * hidden, dtype, name="c_attn")(h), 3, axis=-1))
        attn = gpt.attention(q, k, v).reshape(batch, seq, hidden)
        x = x + Conv1D(hidden, dtype, name="attn_c_proj")(attn)
        h = Conv1D(4 * hidden, dtype, name="c_fc")(gpt.layer_norm(x, "ln_2"))
        return x + Conv1D(hidden, dtype, name="mlp_c_proj")(nn.gelu(h))


class GPT2(gpt.GPT):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        wte = nn.Embed(c.vocab, c.hidden, dtype=dtype, embedding_init=gpt._INIT, name="wte")
        x = wte(tokens) + nn.Embed(c.seq_len, c.hidden, dtype=dtype, embedding_init=gpt._INIT,
                                   name="wpe")(jnp.arange(tokens.shape[1]))[None]
        x = GPT2Stack(c, name="h")(x)
        return wte.attend(gpt.layer_norm(x, "ln_f")).astype(jnp.float32)


class GPT2Stack(nn.Module):
    config: Config

    def setup(self) -> None:
        self.blocks = [GPT2Block(self.config, name=str(i)) for i in range(self.config.layers)]

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return x


def _own_init(model: type[nn.Module], inputs: bool = False) -> Callable[..., Any]:
    """A build from the model's own init, with the example's batch (and with ``inputs``, the sequence for an
    encoder: the tokens reversed, a "translation")."""

    def build(c: Config, seed: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        init_key, data_key = jax.random.split(jax.random.key(seed, impl="rbg"))
        tokens = jax.random.randint(data_key, (c.batch, c.seq_len + 1), 0, c.vocab, jnp.int32)
        m = model(c)
        batch = {"tokens": tokens}
        if inputs:
            batch["inputs"] = jnp.flip(tokens[:, 1:], axis=1)
        params = m.init(init_key, batch, method="loss")["params"]
        state = TrainState.create(apply_fn=m.apply, params=params, tx=_adamw(c))
        return state.replace(step=jnp.zeros((), jnp.int32)), batch

    return build


# ---- an encoder and a decoder ---------------------------------------------------------------------------


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) * q.shape[-1] ** -0.5
    if causal:
        causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bnqk,bknd->bqnd", jax.nn.softmax(scores, axis=-1).astype(q.dtype), v)


class MultiHead(nn.Module):
    """Attention of x's queries over ``memory``'s keys and values (x itself when None)."""

    config: Config
    causal: bool

    @nn.compact
    def __call__(self, x: jax.Array, memory: jax.Array | None = None) -> jax.Array:
        c = self.config
        dense = functools.partial(nn.Dense, dtype=jnp.dtype(c.dtype), kernel_init=gpt._INIT)
        memory = x if memory is None else memory
        split = lambda t: t.reshape(*t.shape[:2], c.heads, c.hidden // c.heads)  # noqa: E731
        q = split(dense(c.hidden, name="query")(x))
        k, v = split(dense(c.hidden, name="key")(memory)), split(dense(c.hidden, name="value")(memory))
        return dense(c.hidden, name="out")(_attend(q, k, v, self.causal).reshape(x.shape))


class EncoderBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + MultiHead(self.config, causal=False, name="self_attn")(gpt.layer_norm(x, "ln_1"))
        return x + gpt.MLP(self.config, name="mlp")(gpt.layer_norm(x, "ln_2"))


class DecoderBlock(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, encoded: jax.Array) -> jax.Array:
        x = x + MultiHead(self.config, causal=True, name="self_attn")(gpt.layer_norm(x, "ln_1"))
        x = x + MultiHead(self.config, causal=False, name="cross_attn")(gpt.layer_norm(x, "ln_2"), encoded)
        return x + gpt.MLP(self.config, name="mlp")(gpt.layer_norm(x, "ln_3"))


class Encoder(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i in range(self.config.layers):
            x = EncoderBlock(self.config, name=f"encoderblock_{i}")(x)
        return gpt.layer_norm(x, "encoder_norm")


class Decoder(nn.Module):
    config: Config

    @nn.compact
    def __call__(self, x: jax.Array, encoded: jax.Array) -> jax.Array:
        for i in range(self.config.layers):
            x = DecoderBlock(self.config, name=f"encoderdecoderblock_{i}")(x, encoded)
        return gpt.layer_norm(x, "decoder_norm")


class EncoderDecoder(nn.Module):
    """``inputs`` [batch, seq] encoded; ``tokens[:, :-1]`` decoded, predicting ``tokens[:, 1:]``. One
    embedding (and tied head) for both sides; ``config.layers`` blocks in each stack."""

    config: Config

    @nn.compact
    def loss(self, batch: dict[str, jax.Array]) -> jax.Array:
        c = self.config
        dtype = jnp.dtype(c.dtype)
        embed = nn.Embed(c.vocab, c.hidden, dtype=dtype, embedding_init=gpt._INIT, name="embed")
        pos = nn.Embed(c.seq_len, c.hidden, dtype=dtype, embedding_init=gpt._INIT, name="pos")
        tokens = batch["tokens"]
        encoded = Encoder(c, name="encoder")(embed(batch["inputs"]) + pos(jnp.arange(c.seq_len))[None])
        x = Decoder(c, name="decoder")(embed(tokens[:, :-1]) + pos(jnp.arange(c.seq_len))[None], encoded)
        logits = embed.attend(x).astype(jnp.float32)
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


# ---- dense and mixture-of-experts blocks alternating ------------------------------------------------------


class Experts(nn.Module):
    """Two experts [h, 2h] → [2h, h], mixed by a softmax gate per token (computed densely)."""

    config: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = jnp.dtype(self.config.dtype)
        gates = jax.nn.softmax(nn.Dense(2, dtype=jnp.float32, kernel_init=gpt._INIT, name="gate")(
            x.astype(jnp.float32)), axis=-1).astype(dtype)
        w_in = self.param("w_in", gpt._INIT, (2, x.shape[-1], 2 * x.shape[-1]))
        w_out = self.param("w_out", gpt._INIT, (2, 2 * x.shape[-1], x.shape[-1]))
        h = nn.gelu(jnp.einsum("bsh,ehf->bsef", x, w_in.astype(dtype)))
        return jnp.einsum("bsef,efh,bse->bsh", h, w_out.astype(dtype), gates)


class AlternatingBlock(nn.Module):
    config: Config
    moe: bool

    @nn.compact
    def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
        x = x + gpt.Attention(self.config, name="attn")(gpt.layer_norm(x, "ln_1"))
        mlp = Experts(self.config, name="moe") if self.moe else gpt.MLP(self.config, name="mlp")
        return x + mlp(gpt.layer_norm(x, "ln_2")), None


class Alternating(_Body):
    pass


def _alternating_stack(c: Config, x: jax.Array) -> jax.Array:
    for i in range(c.layers):
        x, _ = AlternatingBlock(c, moe=i % 2 == 1, name=f"block_{i}")(x)
    return x


STACKS = {"Numbered": _numbered_stack, "FlaxDefault": _flax_default_stack, "Unnumbered": _unnumbered_stack,
          "Alternating": _alternating_stack}


_TINY = gpt.PRESETS["tiny"]

OTHERS: dict[str, Style] = {
    "gpt2": Style("gpt2", {"tiny": dataclasses.replace(_TINY, layers=4)}, _own_init(GPT2), gpt.train_step),
    "encoder_decoder": Style("encoder_decoder", {"tiny": _TINY}, _own_init(EncoderDecoder, inputs=True),
                             gpt.train_step),
    "alternating": Style("alternating", {"tiny": dataclasses.replace(_TINY, layers=4)},
                         _own_init(Alternating), gpt.train_step),
}
