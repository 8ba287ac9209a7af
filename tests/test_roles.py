"""Input roles read off what the step does with each leaf (``autoshard.trace.roles``), whatever the
arguments are called: parameters are differentiated and returned anew, carried state is returned anew,
the batch is only read."""

from __future__ import annotations

import logging
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import autoshard
from autoshard import distributed
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.errors import TraceError
from autoshard.trace import Role, trace

ROOT = Path(__file__).resolve().parents[1]
TX = optax.adam(1e-2)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(16, name="fc")(x)
        return nn.Dense(4, name="out")(jnp.tanh(x))


def _loss(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((_Net().apply({"params": params}, x) - y) ** 2)


def _update(params: dict, opt_state: optax.OptState, x: jax.Array, y: jax.Array) -> tuple:
    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# the same update, written the ways users write it; the optimizer (TX) is closed over
def step_named(params, opt_state, batch):
    params, opt_state, loss = _update(params, opt_state, batch["x"], batch["y"])
    return params, opt_state, {"loss": loss}


def step_terse(p, o, ids):
    return step_named(p, o, ids)


def step_paired(po, tokens):
    p, o, m = step_named(*po, tokens)
    return (p, o), m


def step_loss_first(params, opt_state, batch):
    p, o, m = step_named(params, opt_state, batch)
    return m["loss"], p, o


def step_unpaired(po, tokens):
    p, o, m = step_named(*po, tokens)
    return p, o, m


def _setup(rows: int = 16) -> tuple[dict, optax.OptState, dict]:
    x = jax.random.normal(jax.random.key(0), (rows, 8))
    params = _Net().init(jax.random.key(1), x)["params"]
    y = jax.random.normal(jax.random.key(2), (rows, 4))
    return params, TX.init(params), {"x": x, "y": y}


def _kinds(graph) -> list[str]:
    """Each input leaf's role, by what the leaf is (the names differ between the forms)."""
    out = []
    for t in graph.inputs:
        ten = graph.tensors[t]
        out.append(ten.role.value)
    return out


EXPECTED = ["param"] * 4 + ["state"] + ["opt_state"] * 8 + ["batch"] * 2  # adam: count, mu, nu; then x, y


@pytest.mark.parametrize("form", [step_named, step_terse, step_paired, step_loss_first, step_unpaired],
                         ids=lambda f: f.__name__)
def test_every_signature_gives_the_same_roles(form) -> None:
    params, opt_state, batch = _setup()
    args = ((params, opt_state), batch) if form in (step_paired, step_unpaired) else (params, opt_state, batch)
    graph = trace(form, *args)
    assert _kinds(graph) == EXPECTED, [(graph.tensors[t].name, graph.tensors[t].role.value) for t in graph.inputs]
    # every parameter and optimizer leaf is the new value of a result: donated, laid out alike
    assert sorted(set(graph.output_aliases.values())) == list(range(13))


def test_a_train_state_gives_the_roles_plain_optax_gives() -> None:
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=True)
    state, batch = ex.args
    graph = trace(ex.train_step, state, batch)
    roles = {graph.tensors[t].name: graph.tensors[t].role for t in graph.inputs}
    for name, role in roles.items():
        if name.startswith("state.params."):
            assert role is Role.PARAM, name
        elif ".mu." in name or ".nu." in name:
            assert role is Role.OPT_STATE, name
        elif name.startswith("batch."):
            assert role is Role.BATCH, name
        else:  # the step counter and Adam's count: carried, not differentiated
            assert role is Role.STATE, name
    assert roles["state.step"] is Role.STATE and roles["state.opt_state[0].count"] is Role.STATE

    # the same model as step(params, opt_state, batch) over plain optax: the same role for each leaf
    tx = optax.adamw(1e-3)

    def plain(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: state.apply_fn({"params": p}, batch, method="loss"))(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    g2 = trace(plain, state.params, jax.eval_shape(tx.init, state.params), batch)
    by_name = {g2.tensors[t].name: g2.tensors[t].role for t in g2.inputs}
    for name, role in by_name.items():
        twin = "state." + name if name.startswith(("params.", "opt_state")) else name
        assert roles[twin] is role, (name, role, roles[twin])


class _BNNet(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(8)(x)
        x = nn.BatchNorm(use_running_average=False)(x)
        return nn.Dense(1)(x)


def test_batch_statistics_rng_keys_and_hyperparameters_are_state() -> None:
    x = jnp.ones((16, 4))
    variables = _BNNet().init(jax.random.key(0), x)
    tx = optax.sgd(0.1)

    def step(variables, opt_state, key, lr, x):
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, x.shape)

        def loss_fn(p):
            y, new = _BNNet().apply({"params": p, "batch_stats": variables["batch_stats"]}, x + noise,
                                    mutable=["batch_stats"])
            return jnp.mean(y ** 2) * lr, new

        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state)
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, "batch_stats": new["batch_stats"]}, opt_state, key, loss

    graph = trace(step, variables, tx.init(variables["params"]), jax.random.key(1), 0.5, x)
    roles = {graph.tensors[t].name: graph.tensors[t].role for t in graph.inputs}
    assert {r for n, r in roles.items() if ".params." in n} == {Role.PARAM}
    assert {r for n, r in roles.items() if ".batch_stats." in n} == {Role.STATE}
    assert roles["key"] is Role.STATE  # returned anew, never differentiated
    assert roles["lr"] is Role.STATE  # a scalar has no rows: not the batch
    assert roles["x"] is Role.BATCH


def test_consumed_only_leaves_that_cannot_be_the_batch() -> None:
    params, opt_state, batch = _setup(rows=16)
    frozen = {"w": jnp.ones((8, 8))}
    mask = jnp.ones((3, 3))

    def step(params, frozen_params, opt_state, batch, mask):
        x = batch["x"] @ frozen_params["w"] * mask.sum()
        return step_named(params, opt_state, {"x": x, "y": batch["y"]})

    graph = trace(step, params, frozen, opt_state, batch, mask)
    roles = {graph.tensors[t].name: graph.tensors[t].role for t in graph.inputs}
    assert roles["frozen_params.w"] is Role.PARAM  # read only, but named so: frozen weights
    assert roles["mask"] is Role.STATE  # read only, but its leading dimension (3) is not the batch's (16)
    assert roles["batch.x"] is Role.BATCH and roles["batch.y"] is Role.BATCH


def test_a_prediction_shaped_like_its_input_is_not_its_new_value() -> None:
    params, opt_state, batch = _setup()

    def autoencode(params, opt_state, x):
        p, o, m = step_named(params, opt_state, {"x": x, "y": x[:, :4]})
        return p, o, {"loss": m["loss"], "reconstruction": x * m["loss"]}

    graph = trace(autoencode, params, opt_state, batch["x"])
    assert graph.tensors[graph.inputs[-1]].role is Role.BATCH
    assert len(graph.inputs) - 1 not in set(graph.output_aliases.values())


def test_overrides_by_path_and_by_position() -> None:
    params, opt_state, batch = _setup()
    g = trace(step_named, params, opt_state, batch, roles={"batch.y": "state"})
    assert [g.tensors[t].role for t in g.inputs][-2:] == [Role.BATCH, Role.STATE]
    g = trace(step_named, params, opt_state, batch, batch_argnums=(1,))
    assert {g.tensors[t].role for t in g.inputs[4:13]} == {Role.BATCH}
    g = trace(step_named, params, opt_state, batch, roles={1: "state", "opt_state[0].count": "opt_state"})
    assert g.tensors[g.inputs[4]].role is Role.OPT_STATE and g.tensors[g.inputs[5]].role is Role.STATE
    with pytest.raises(TraceError, match="argument 5 is not an argument"):
        trace(step_named, params, opt_state, batch, roles={5: "batch"})
    with pytest.raises(TraceError, match="argument positions"):
        trace(step_named, params, opt_state, batch, batch_argnums=("batch",))


def test_a_step_without_gradients_falls_back_to_names() -> None:
    def evaluate(state, batch):
        return state["params"]["w"].sum() + batch["x"].sum()

    g = trace(evaluate, {"params": {"w": jnp.ones((4, 3))}}, {"x": jnp.ones((6, 3))})
    assert [g.tensors[t].role for t in g.inputs] == [Role.PARAM, Role.BATCH]


def test_processes_take_only_the_batch_as_their_rows() -> None:
    params, opt_state, batch = _setup()
    local = distributed.local_leaves(step_terse, (params, opt_state, batch))
    assert local == [False] * 13 + [True] * 2
    shapes = jax.tree.leaves(distributed.global_shapes(step_terse, (params, opt_state, batch)))
    assert shapes[4].shape == () and shapes[-1].shape == (16, 4)  # Adam's count is no batch to stack


def test_plain_optax_step_plans_without_batch_noise(caplog: pytest.LogCaptureFixture) -> None:
    params, opt_state, batch = _setup()
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        autoshard.plan(step_terse, params, opt_state, batch, mesh=(2, 4), time_budget_s=3)
    assert not [r for r in caplog.records if "rows, which no mesh axis" in r.getMessage()]


def test_plain_optax_step_pipelines_and_matches_jit() -> None:
    # was: IndexError in microbatch_args (Adam's scalar count, named "batch" by position, split in two)
    params, opt_state, batch = _setup()
    step = autoshard.parallelize(step_named, mesh=(2, 4), microbatches=2, pipeline=True, time_budget_s=8)
    want = jax.jit(step_named)
    p1, o1, p2, o2 = params, opt_state, params, opt_state
    got_l, want_l = [], []
    for _ in range(2):
        p1, o1, m1 = step(p1, o1, batch)
        p2, o2, m2 = want(p2, o2, batch)
        got_l.append(float(m1["loss"]))
        want_l.append(float(m2["loss"]))
    assert isinstance(step.plan, autoshard.PipelinePlan)
    assert global_rel_error(np.array(want_l), np.array(got_l)) <= 1e-5
    assert global_rel_error(jax.tree.leaves(o2), jax.tree.leaves(o1)) <= 1e-5
