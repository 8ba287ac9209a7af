"""The example GPT with 4 blocks (tiny preset) as the steps the pipeline tests run: ``make(form)`` returns
``(train_step, state_args, batch)`` with ``train_step(*state_args, batch) -> (*new_state, metrics)``.
``state``: the example's flax ``TrainState`` step; ``optax``: ``step(params, opt_state, batch)`` over
plain optax, the optimizer closed over; either with ``:scan`` (``state:scan``): the blocks written as one
``nn.scan`` (``scan_layers=true``). ``llama``: ``examples/llama.py`` (tiny); ``style:NAME``: the example GPT
with 4 blocks written in another style (``tests/style_models.py``: ``numbered``, ``unnumbered``, ...)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import optax

from autoshard._examples import load_example

ROOT = Path(__file__).resolve().parents[2]


def make(form: str, **overrides: Any) -> tuple[Any, tuple[Any, ...], Any]:
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
