"""The model files in examples/: the convention, a few real steps, exact parameter and flop counts.

Runs under the strict dtype promotion that conftest.py sets, which is part of what is being tested.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.training.train_state import TrainState

from autoshard._examples import load_example, load_module

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = ["mlp", "gpt", "moe", "wide_resnet", "llama"]
BIGGEST = {"mlp": "wide", "gpt": "39b", "moe": "70b", "wide_resnet": "13b", "llama": "70b"}
# A name every layer of the unrolled tiny model carries in its equations' name stacks.
LAYER_TAGS = {
    "mlp": ["dense_0", "dense_1", "dense_2"],
    "gpt": ["block_0", "block_1"],
    "moe": ["block_0", "block_1"],
    "wide_resnet": [f"stage_{i}_block_0" for i in range(4)],
    "llama": ["layers", "0", "1", "2", "3"],  # layers/0 … layers/3
}


@functools.cache
def example(name: str) -> ModuleType:
    return load_module(EXAMPLES / f"{name}.py")


def n_params(state: TrainState) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state.params))


def all_eqns(jaxpr: jax.extend.core.Jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_steps_lower_the_loss(name: str) -> None:
    m = example(name)
    state, batch = m.make("tiny")
    step = jax.jit(m.train_step)
    losses = []
    for _ in range(3):
        state, metrics = step(state, batch)  # the same batch each time: the loss must go down
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)), losses
    assert losses[0] > losses[1] > losses[2], losses
    assert int(state.step) == 3


@pytest.mark.parametrize("name", NAMES)
def test_convention(name: str) -> None:
    m = example(name)
    assert "tiny" in m.PRESETS and BIGGEST[name] in m.PRESETS
    for config in m.PRESETS.values():
        assert dataclasses.is_dataclass(config) and config.__dataclass_params__.frozen
        for field in dataclasses.fields(config):
            assert type(getattr(config, field.name)) in (bool, int, float, str), field.name
    ex = load_example(EXAMPLES / f"{name}.py", "tiny", ["batch=4"], abstract=True)
    state, batch = ex.args
    assert ex.config.batch == 4 and isinstance(state, TrainState) and isinstance(batch, dict)
    assert all(leaf.shape[0] == 4 for leaf in jax.tree.leaves(batch))


def leaf_types(tree: object) -> list[tuple[str, tuple[int, ...], jnp.dtype]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(path), leaf.shape, leaf.dtype) for path, leaf in leaves]


@pytest.mark.parametrize("name", NAMES)
def test_abstract_matches_concrete(name: str) -> None:
    m = example(name)
    state, batch = m.make("tiny")
    abstract = m.make("tiny", abstract=True)
    assert leaf_types(abstract) == leaf_types((state, batch))
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves((state, batch)))
    assert abstract[0].apply_fn is not None and abstract[0].tx is not None


def test_the_seed_changes_the_batch() -> None:
    mlp = example("mlp")
    assert not np.array_equal(mlp.make("tiny", seed=0)[1]["x"], mlp.make("tiny", seed=1)[1]["x"])


@pytest.mark.parametrize(("name", "overrides"), [*[(n, {}) for n in NAMES], ("gpt", {"scan_layers": True})])
def test_biggest_preset_is_abstract(name: str, overrides: dict) -> None:
    m = example(name)
    preset = BIGGEST[name]
    state, batch = m.make(preset, abstract=True, **overrides)
    leaves = jax.tree.leaves((state, batch))
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert callable(state.apply_fn)
    if hasattr(m, "param_count"):
        assert n_params(state) == m.param_count(dataclasses.replace(m.PRESETS[preset], **overrides))


@pytest.mark.parametrize("name", NAMES)
def test_param_count_is_exact(name: str) -> None:
    m = example(name)
    state, _ = m.make("tiny")
    assert n_params(state) == m.param_count(m.PRESETS["tiny"])
    # The biggest preset is checked by test_biggest_preset_is_abstract, the others by the slow test below.


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_param_count_is_exact_for_every_preset(name: str) -> None:
    m = example(name)
    overrides = {"scan_layers": True} if name == "gpt" else {}  # the same count, faster to build
    for preset, config in m.PRESETS.items():
        state, _ = m.make(preset, abstract=True, **overrides)
        assert n_params(state) == m.param_count(config), preset


def test_alpa_sizes() -> None:
    """Each Alpa-shaped preset holds the parameter count in its name (to 5%: the names are rounded)."""
    for name in ["gpt", "moe", "wide_resnet"]:
        m = example(name)
        for preset, config in m.PRESETS.items():
            if preset[-1] in "mb":
                size = float(preset[:-1]) * (1e6 if preset[-1] == "m" else 1e9)
                assert m.param_count(config) == pytest.approx(size, rel=0.05), (name, preset)


@pytest.mark.parametrize("tie", [True, False])
def test_gpt_forward_flops_counts_the_matmuls(tie: bool) -> None:
    gpt = example("gpt")
    state, batch = gpt.make("tiny", abstract=True, tie_embeddings=tie)
    config = dataclasses.replace(gpt.PRESETS["tiny"], tie_embeddings=tie)
    forward = jax.make_jaxpr(lambda p, b: state.apply_fn({"params": p}, b, method="loss"))
    flops = 0
    for eqn in all_eqns(forward(state.params, batch).jaxpr):
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
    assert flops == gpt.forward_flops(config)


def test_gpt_scan_equals_unrolled() -> None:
    gpt = example("gpt")
    unrolled, batch = gpt.make("tiny")
    scanned, _ = gpt.make("tiny", abstract=True, scan_layers=True)
    layers = gpt.PRESETS["tiny"].layers
    params = dict(unrolled.params)
    blocks = [params.pop(f"block_{i}") for i in range(layers)]
    params["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    assert jax.tree.structure(params) == jax.tree.structure(scanned.params)

    def loss(state: TrainState, p: dict) -> jax.Array:
        return jax.jit(lambda p: state.apply_fn({"params": p}, batch, method="loss"))(p)

    np.testing.assert_allclose(loss(scanned, params), loss(unrolled, unrolled.params), rtol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_step_traces_under_strict_promotion(name: str) -> None:
    m = example(name)
    state, batch = m.make("tiny", abstract=True, dtype="bfloat16")
    new_state, metrics = jax.eval_shape(m.train_step, state, batch)
    assert metrics["loss"].dtype == jnp.float32
    assert jax.tree.map(lambda x: x.dtype, new_state.params) == jax.tree.map(lambda x: x.dtype, state.params)


@pytest.mark.parametrize("name", NAMES)
def test_layers_tag_the_name_stack(name: str) -> None:
    m = example(name)
    jaxpr = jax.make_jaxpr(m.train_step)(*m.make("tiny", abstract=True))
    stacks = {str(eqn.source_info.name_stack) for eqn in all_eqns(jaxpr.jaxpr)}
    for tag in LAYER_TAGS[name]:
        assert any(tag in s.split("/") for s in stacks), (tag, sorted(stacks)[:10])


def test_gpt_scanned_layers_are_named() -> None:
    gpt = example("gpt")
    state, batch = gpt.make("tiny", abstract=True, scan_layers=True, remat=True)
    assert state.params["blocks"]["attn"]["qkv"]["kernel"].shape == (2, 64, 192)
    jaxpr = jax.make_jaxpr(gpt.train_step)(state, batch)
    stacks = {str(eqn.source_info.name_stack) for eqn in all_eqns(jaxpr.jaxpr)}
    assert any("blocks/attn/qkv" in s for s in stacks)


def test_moe_routing_respects_capacity() -> None:
    moe = example("moe")
    logits = np.random.default_rng(0).normal(size=(3, 32, 4)).astype(np.float32)
    gates = np.exp(logits) / np.sum(np.exp(logits), axis=-1, keepdims=True)
    for capacity in (4, 64):
        outs = jax.jit(moe.top2_routing, static_argnums=1)(gates, capacity)
        dispatch, combine, aux = (np.asarray(x) for x in outs)
        assert dispatch.shape == combine.shape == (3, 32, 4, capacity)
        assert np.max(np.sum(dispatch, axis=1)) <= 1  # a slot holds at most one token
        per_token = np.sum(dispatch, axis=(2, 3))
        assert np.max(per_token) <= 2
        assert np.max(np.sum(combine, axis=(2, 3))) <= 1 + 1e-6
        assert 0 < aux < 4  # E·Σₑ fₑ·pₑ: 1 when balanced, E when one expert takes all
        if capacity == 64:  # room for every choice: nothing dropped, the two gates sum to one
            np.testing.assert_array_equal(per_token, 2)
            np.testing.assert_allclose(np.sum(combine, axis=(2, 3)), 1, rtol=1e-6)
