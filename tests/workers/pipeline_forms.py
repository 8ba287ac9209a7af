"""The example GPT with 4 blocks (tiny preset) as the steps the pipeline tests run: ``make(form)`` returns
``(train_step, state_args, batch)`` with ``train_step(*state_args, batch) -> (*new_state, metrics)``.
``state``: the example's flax ``TrainState`` step; ``optax``: ``step(params, opt_state, batch)`` over
plain optax, the optimizer closed over; either with ``:scan`` (``state:scan``): the blocks written as one
``nn.scan`` (``scan_layers=true``). ``llama``: ``examples/llama.py`` (tiny); ``style:NAME``: the example GPT
with 4 blocks written in another style (``tests/style_models.py``: ``numbered``, ``unnumbered``, ...).
``mlp``: four residual MLP blocks after an input projection; ``mlp:batch``: the same with no projection, the
first block reading the batch directly. ``dropout``: a linen LM with dropout on the embedding, in its 4 blocks
and before its head, ``step(state, key, batch)`` splitting a legacy ``PRNGKey`` and returning the other half."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from autoshard._examples import load_example

ROOT = Path(__file__).resolve().parents[2]


def residual_mlp(embed: bool) -> tuple[Any, tuple[Any, ...], Any]:
    """Four residual MLP blocks ``x + down(gelu(up(x)))`` on 16 features, after an input projection
    (``embed``) or reading the batch directly: ``(train_step, (state,), batch)``."""
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return x + nn.Dense(16, name="down")(jax.nn.gelu(nn.Dense(32, name="up")(x)))

    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            if embed:
                x = nn.Dense(16, name="embed")(x)
            for i in range(4):
                x = Block(name=f"block_{i}")(x)
            return jnp.mean(x**2)

    model = Deep()
    x = jax.random.normal(jax.random.key(1), (32, 16))
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), x[:1])["params"],
                              tx=optax.adam(1e-2))

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        loss, grads = jax.value_and_grad(lambda p: state.apply_fn({"params": p}, batch["x"]))(state.params)
        with jax.numpy_dtype_promotion("standard"):  # the tests run with strict promotion; optax's count
            return state.apply_gradients(grads=grads), {"loss": loss}

    return train_step, (state,), {"x": x}


def dropout_lm() -> tuple[Any, tuple[Any, ...], Any]:
    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, train: bool) -> jax.Array:
            h = nn.Dense(64, name="up")(nn.LayerNorm(name="ln")(x))
            return x + nn.Dense(32, name="down")(nn.Dropout(0.1)(jax.nn.gelu(h), deterministic=not train))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, ids: jax.Array, train: bool = False) -> jax.Array:
            x = nn.Dropout(0.1)(nn.Embed(64, 32, name="embed")(ids), deterministic=not train)
            for i in range(4):
                x = Block(name=f"block_{i}")(x, train)
            return nn.Dense(64, name="head")(nn.Dropout(0.2)(x, deterministic=not train))

    model = Model()
    ids = jax.random.randint(jax.random.key(5), (16, 16), 0, 64, jnp.int32)
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(0), ids)["params"],
                              tx=optax.adam(1e-3))

    def train_step(state: TrainState, key: jax.Array, batch: dict) -> tuple[TrainState, jax.Array, dict]:
        key, sub = jax.random.split(key)

        def loss_fn(p: Any) -> jax.Array:
            logits = state.apply_fn({"params": p}, batch["ids"], True, rngs={"dropout": sub})
            return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["ids"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes a Python float and an int32 count
            return state.apply_gradients(grads=grads), key, {"loss": loss}

    return train_step, (state, jax.random.PRNGKey(1)), {"ids": ids}


def make(form: str, **overrides: Any) -> tuple[Any, tuple[Any, ...], Any]:
    if form in ("mlp", "mlp:batch"):
        return residual_mlp(embed=form == "mlp")
    if form == "dropout":
        return dropout_lm()
    if form == "llama":  # examples/llama.py: layers/0.., a padding mask and RoPE tables read by every block
        ex = load_example(ROOT / "examples" / "llama.py", "tiny", [], abstract=False)
        state, batch = ex.args
        return ex.train_step, (state,), batch
    if form.startswith("style:"):  # the example GPT written in another style (tests/style_models.py)
        sys.path.insert(0, str(ROOT / "tests"))
        import style_models

        model = style_models.STYLES[form[len("style:"):]]
        state, batch = model.make("tiny", layers=4)
        return model.train_step, (state,), batch
    form, _, how = form.partition(":")  # "state:scan": the blocks written as one nn.scan (scan_layers=true)
    if how == "scan":
        overrides["scan_layers"] = "true"
    if how == "heavy":  # a tail (LM head and loss) that costs several blocks: 32768 words, 8 rows a microbatch
        overrides.update(vocab=32768, batch=32)
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [f"{k}={v}" for k, v in
                                                            {"layers": 4, **overrides}.items()], abstract=False)
    state, batch = ex.args
    if form == "state":
        return ex.train_step, (state,), batch
    tx = optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1)
    apply = state.apply_fn

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, dict[str, Any]]:
        loss, grads = jax.value_and_grad(lambda p: apply({"params": p}, batch, method="loss"))(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss}

    return step, (state.params, tx.init(state.params)), batch
