"""flax nnx as its own guide teaches it: a step that takes its Model and Optimizer, updates them in place
(``optimizer.update(model, grads)``) and returns only the loss runs under ``parallelize`` as under
``nnx.jit`` (``autoshard.nnx_steps``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import autoshard
from autoshard.emit import global_rel_error
from autoshard.errors import AutoshardError

TOL = 1e-5
BATCH = 16


@pytest.fixture(autouse=True)
def _standard_promotion():
    # optax's bias correction raises a float to the power of nnx's int32 step count
    with jax.numpy_dtype_promotion("standard"):
        yield


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(16, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 64, rngs=rngs)
        self.l3 = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def _model_and_optimizer() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _batches(n: int = 3) -> list[tuple[jax.Array, jax.Array]]:
    out = []
    for i in range(n):
        x = jax.random.normal(jax.random.key(10 + i), (BATCH, 16))
        out.append((x, jnp.tanh(x[:, :4] * 2.0)))
    return out


def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    """The step of flax's guide, word for word but for the decorator."""

    def loss_fn(model: MLP) -> jax.Array:
        return ((model(x) - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def _on_every_device(tree, mesh: jax.sharding.Mesh) -> None:
    want = set(mesh.devices.flat)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        assert isinstance(leaf, jax.Array), (path, type(leaf))
        assert leaf.sharding.device_set == want, (jax.tree_util.keystr(path), leaf.sharding)


def test_the_guide_step_updates_model_and_optimizer_in_place_as_nnx_jit_does() -> None:
    ref_model, ref_opt = _model_and_optimizer()
    model, optimizer = _model_and_optimizer()
    ref = nnx.jit(train_step)
    traced = []

    @functools.wraps(train_step)
    def counted(*args):
        traced.append(1)
        return train_step(*args)

    par = autoshard.parallelize(counted, mesh=(2, 4), time_budget_s=5)
    losses, ref_losses = [], []
    for x, y in _batches():
        ref_losses.append(ref(ref_model, ref_opt, x, y))
        losses.append(par(model, optimizer, x, y))
        if len(losses) == 1:
            traces_after_first = len(traced)
    assert global_rel_error(jnp.stack(ref_losses), jnp.stack(losses)) <= TOL
    assert float(losses[-1]) < float(losses[0])  # it trains: the updates were written back
    assert global_rel_error(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= TOL
    assert global_rel_error(nnx.state(ref_opt), nnx.state(optimizer)) <= TOL
    assert int(optimizer.step[...]) == int(ref_opt.step[...]) == 3
    _on_every_device(nnx.state((model, optimizer)), par.device_mesh)
    assert par.device_mesh.devices.size == 8
    # later steps reuse the compiled program: the step is not traced again, one program is cached
    assert len(traced) == traces_after_first and len(par._cache) == 1
    # the plan reads the arguments by their names: the model's weights, the optimizer's moments, the batch
    names = {par.graph.tensors[t].name for t in par.graph.inputs}
    assert {"model.l1.kernel.value", "x", "y"} <= names, sorted(names)
    assert any(n.startswith("optimizer.opt_state") for n in names)
    assert "predicted step time" in par.explain()


class Trainer(nnx.Module):
    """Holds a reference to the model (as nnx.Optimizer did before flax 0.11) and a counter of its own."""

    def __init__(self, model: MLP) -> None:
        self.model = model
        self.optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))


def shared_step(model: MLP, trainer: Trainer, x: jax.Array, y: jax.Array) -> dict:
    def loss_fn(m: MLP) -> jax.Array:
        return ((m(x) - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(trainer.model)  # the shared object, reached through trainer
    trainer.optimizer.update(trainer.model, grads)
    trainer.steps[...] += 1
    return {"loss": loss, "first": model(x[:1])}


def test_an_object_two_arguments_share_is_one_object_with_one_state() -> None:
    ref_model = MLP(nnx.Rngs(0))
    ref_trainer = Trainer(ref_model)
    model = MLP(nnx.Rngs(0))
    trainer = Trainer(model)
    ref = nnx.jit(shared_step)
    par = autoshard.parallelize(shared_step, mesh=(2, 4), time_budget_s=5)
    for x, y in _batches():
        want, got = ref(ref_model, ref_trainer, x, y), par(model, trainer, x, y)
        assert global_rel_error(want, got) <= TOL
    assert trainer.model is model and int(trainer.steps[...]) == 3
    assert global_rel_error(nnx.state(ref_model, nnx.Param), nnx.state(model, nnx.Param)) <= TOL
    # each weight is one input of the program (the optimizer's view of the model is not a second copy)
    n_state = len(jax.tree_util.tree_leaves(nnx.state((model, trainer))))
    assert len(par.graph.inputs) == n_state + 2
    _on_every_device(nnx.state((model, trainer)), par.device_mesh)


def test_the_functional_form_and_a_plain_step_still_run_as_before() -> None:
    model, optimizer = _model_and_optimizer()
    graphdef, state = nnx.split((model, optimizer))

    def functional(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, x, y)
        return nnx.state((model, optimizer)), loss

    ref_state = state
    par = autoshard.parallelize(functional, mesh=(2, 4), time_budget_s=5)
    for x, y in _batches(2):
        ref_state, ref_loss = jax.jit(functional)(ref_state, x, y)
        state, loss = par(state, x, y)
        assert global_rel_error(ref_loss, loss) <= TOL
    assert global_rel_error(ref_state, state) <= TOL
    assert not par._functional and len(par._cache) == 1


def test_a_step_that_returns_an_object_it_was_given_returns_the_callers_object() -> None:
    model, optimizer = _model_and_optimizer()

    def step(model, optimizer, x, y):
        return model, train_step(model, optimizer, x, y)

    par = autoshard.parallelize(step, mesh=(8,), time_budget_s=5)
    (x, y), = _batches(1)
    before = jnp.copy(model.l1.kernel[...])
    out, loss = par(model, optimizer, x, y)
    assert out is model and jnp.isfinite(loss)
    assert not jnp.allclose(before, model.l1.kernel[...])


class Counting(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(16, 4, rngs=rngs)
        self.calls = 0  # a plain Python attribute, not nnx state

    def __call__(self, x: jax.Array) -> jax.Array:
        self.calls += 1
        return self.l1(x)


def test_a_step_that_changes_a_plain_python_attribute_is_refused_naming_it() -> None:
    model = Counting(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    (x, y), = _batches(1)
    par = autoshard.parallelize(train_step, mesh=(8,), time_budget_s=5)
    with pytest.raises(AutoshardError, match=r"model\.calls changed from 0 to 1.*graphdef.*nnx\.Variable"):
        par(model, optimizer, x, y)
    assert model.calls == 0


def test_nnx_objects_mixed_with_arrays_in_one_argument_are_refused_with_the_fix() -> None:
    model, optimizer = _model_and_optimizer()
    (x, y), = _batches(1)

    def step(parts, x, y):
        return train_step(parts["model"], parts["optimizer"], x * parts["scale"], y)

    par = autoshard.parallelize(step, mesh=(8,), time_budget_s=5)
    with pytest.raises(AutoshardError, match=r"argument 0 \(parts\) holds flax nnx objects .*separate"):
        par({"model": model, "optimizer": optimizer, "scale": jnp.ones(())}, x, y)


def test_a_step_that_returns_a_new_object_is_refused() -> None:
    model, optimizer = _model_and_optimizer()
    (x, y), = _batches(1)

    def step(model, optimizer, x, y):
        train_step(model, optimizer, x, y)
        return nnx.Linear(4, 4, rngs=nnx.Rngs(1))

    with pytest.raises(AutoshardError, match=r"returns a flax nnx Linear that it created"):
        autoshard.parallelize(step, mesh=(8,), time_budget_s=5)(model, optimizer, x, y)


def test_plan_takes_the_guide_step_and_abstract_objects() -> None:
    model, optimizer = nnx.eval_shape(_model_and_optimizer)
    x, y = jax.ShapeDtypeStruct((BATCH, 16), jnp.float32), jax.ShapeDtypeStruct((BATCH, 4), jnp.float32)
    plan = autoshard.plan(train_step, model, optimizer, x, y, mesh=(2, 4), hardware="h100", time_budget_s=5)
    assert plan.specs and "predicted step time" in autoshard.explain(plan)
