"""examples/llama.py beyond the model-file convention (tests/test_examples.py): the padding mask is what
the model reads, and the fused attention computes what the materialised one does."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from autoshard._examples import load_module
from autoshard.emit import global_rel_error

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@functools.cache
def llama():
    return load_module(EXAMPLES / "llama.py")


def _loss_and_grads(state, batch):
    loss = jax.value_and_grad(lambda p: state.apply_fn({"params": p}, batch, method="loss"))
    return jax.jit(loss)(state.params)


def test_padding_is_masked() -> None:
    """What the padding holds changes nothing (it is neither attended to by a real token nor counted in the
    loss); what a real token holds does."""
    state, batch = llama().make("tiny")
    mask = np.asarray(batch["attention_mask"])
    assert 0 < mask.sum() < mask.size  # some rows are padded
    loss = jax.jit(lambda b: state.apply_fn({"params": state.params}, b, method="loss"))
    scrambled = {k: jnp.where(mask == 0, (v + 7) % llama().PRESETS["tiny"].vocab, v) if k != "attention_mask"
                 else v for k, v in batch.items()}
    assert float(loss(scrambled)) == float(loss(batch))
    real = dict(batch, input_ids=batch["input_ids"].at[0, 0].add(1))
    assert float(loss(real)) != float(loss(batch))


@pytest.mark.slow  # the Pallas kernels are interpreted on CPU
def test_flash_equals_the_materialised_attention() -> None:
    state, batch = llama().make("tiny")
    fused, _ = llama().make("tiny", flash=True)
    want = _loss_and_grads(state, batch)
    got = _loss_and_grads(fused.replace(params=state.params), batch)
    assert global_rel_error(want, got) <= 1e-5
