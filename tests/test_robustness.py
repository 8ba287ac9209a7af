"""Ordinary JAX code and ordinary mistakes: JAX meshes, flax nnx steps, debug prints, FFTs, typed PRNG keys,
Python leaves in the state, saved plans, and arguments that are refused with a message naming the fix."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import autoshard
from autoshard._examples import load_example
from autoshard.cli import main
from autoshard.emit import global_rel_error
from autoshard.target import PlanningError, Target, parse_bytes, parse_mesh

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _mlp():
    return load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=False)


def _matches_jit(step, args, par, steps: int = 2) -> None:
    ref = jax.jit(step)
    s_ref, *rest = args
    s_par = s_ref
    for _ in range(steps):
        s_ref, m_ref = ref(s_ref, *rest)
        s_par, m_par = par(s_par, *rest)
        assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
        assert global_rel_error(s_ref, s_par) <= TOL


# ---- JAX meshes ---------------------------------------------------------------------------------------------


def test_a_mesh_from_make_mesh_runs_on_its_devices_with_its_axis_names() -> None:
    ex = _mlp()
    mesh = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes by default: autoshard makes them Auto
    par = autoshard.parallelize(ex.train_step, mesh=mesh, time_budget_s=5)
    _matches_jit(ex.train_step, ex.args, par)
    assert par.plan.mesh.axis_names == ("data", "model") and par.plan.mesh.shape == (2, 4)


def test_a_mesh_over_four_of_the_eight_devices() -> None:
    ex = _mlp()
    devices = jax.devices()[4:]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 2), ("a", "b"))
    par = autoshard.parallelize(ex.train_step, mesh=mesh, time_budget_s=5)
    _matches_jit(ex.train_step, ex.args, par)
    new_state, _ = par(*ex.args)
    used = {d for leaf in jax.tree_util.tree_leaves(new_state) for d in leaf.sharding.device_set}
    assert used == set(devices)


def test_plan_takes_an_abstract_mesh_and_parallelize_says_it_needs_devices() -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=True)
    abstract = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=abstract, hardware="h100", time_budget_s=5)
    assert plan.mesh.axis_names == ("data", "model")
    par = autoshard.parallelize(ex.train_step, mesh=abstract)
    with pytest.raises(PlanningError, match="AbstractMesh has no devices"):
        par(*_mlp().args)


def test_mesh_arguments_that_cannot_be_meant_are_refused() -> None:
    with pytest.raises(PlanningError, match="repeat 'data'"):
        parse_mesh((2, 2), ["data", "data"])
    with pytest.raises(PlanningError, match="expected sizes"):
        parse_mesh(("x", "y"))
    assert main(["plan", str(ROOT / "examples" / "mlp.py"), "--mesh", "2x2", "--axes", "data,data", "-q"]) == 2


# ---- flax nnx --------------------------------------------------------------------------------------------------


class _Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jax.nn.relu(self.l1(x)))


def _loss(model: _Net, batch: dict) -> jax.Array:
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _nnx_setup():
    model = _Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    return model, optimizer, {"x": x, "y": jnp.tanh(x[:, :4])}


@jax.numpy_dtype_promotion("standard")  # optax's bias correction raises a float to nnx's int32 step count
def test_a_functional_nnx_step_parallelizes_and_matches_jit() -> None:
    model, optimizer, batch = _nnx_setup()
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), {"loss": loss}

    par = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=5)
    _matches_jit(step, (state, batch), par, steps=3)


@jax.numpy_dtype_promotion("standard")
def test_an_nnx_step_that_updates_in_place_runs_as_nnx_jit_runs_it() -> None:
    model, optimizer, batch = _nnx_setup()
    ref_model, ref_optimizer, _ = _nnx_setup()

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(_loss)(model, batch)
        optimizer.update(model, grads)
        return {"loss": loss}

    par, ref = autoshard.parallelize(step, mesh=(8,), time_budget_s=5), nnx.jit(step)
    for _ in range(2):
        assert global_rel_error(ref(ref_model, ref_optimizer, batch), par(model, optimizer, batch)) <= TOL
    assert global_rel_error(nnx.state(ref_model), nnx.state(model)) <= TOL


# ---- ordinary code that used to crash ---------------------------------------------------------------------------


def _linear_step(extra):
    def step(state, batch):
        def loss(w):
            return extra(batch["x"] @ w)

        value, g = jax.value_and_grad(loss)(state["w"])
        return {"w": state["w"] - 0.1 * g}, {"loss": value}

    state = {"w": jax.random.normal(jax.random.key(0), (16, 16)) / 4}
    return step, (state, {"x": jax.random.normal(jax.random.key(1), (32, 16))})


def test_a_step_with_debug_print_plans_and_runs_with_no_missing_rule(caplog, capfd) -> None:
    def printed(y):
        jax.debug.print("sum {s}", s=y.sum())
        return (y**2).mean()

    step, args = _linear_step(printed)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        par = autoshard.parallelize(step, mesh=(8,), time_budget_s=5)
        _matches_jit(step, args, par)
    assert "no sharding rule" not in caplog.text and "no cost rule" not in caplog.text
    assert "sum " in capfd.readouterr().out


def test_a_cloned_key_plans_and_runs_with_no_missing_rule(caplog) -> None:
    """``jax.random.clone`` (what ``nn.scan`` traces for ``split_rngs``) is key plumbing like a split: no cost or
    sharding rule missing, and the step gives jax.jit's numbers."""
    def noisy(y):
        return (y * jax.random.uniform(jax.random.clone(jax.random.key(2)), y.shape)).mean()

    step, args = _linear_step(noisy)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        par = autoshard.parallelize(step, mesh=(8,), time_budget_s=5)
        _matches_jit(step, args, par)
    assert "no sharding rule" not in caplog.text and "no cost rule" not in caplog.text, caplog.text


def test_an_fft_keeps_its_transformed_dimension_whole() -> None:
    step, args = _linear_step(lambda y: (jnp.abs(jnp.fft.fft(y)) ** 2).mean())
    graph = autoshard.trace(step, *args)
    fft_out = next(op.outputs[0] for op in graph.ops if op.primitive == "fft")
    par = autoshard.parallelize(step, mesh=(2, 4), time_budget_s=5)
    _matches_jit(step, args, par)
    spec = par.plan.specs[()].get(fft_out)
    assert spec is not None and not spec.dims[-1], spec


def test_a_typed_prng_key_in_the_state_plans_runs_and_explains() -> None:
    def step(state, batch):
        key, sub = jax.random.split(state["key"])
        noise = 1e-3 * jax.random.normal(sub, state["w"].shape)
        loss, g = jax.value_and_grad(lambda w: ((batch["x"] @ w) ** 2).mean())(state["w"] + noise)
        return {"w": state["w"] - 0.1 * g, "key": key}, {"loss": loss}

    state = {"w": jnp.ones((16, 16)) / 16, "key": jax.random.key(0)}
    batch = {"x": jax.random.normal(jax.random.key(1), (32, 16))}
    par = autoshard.parallelize(step, mesh=(8,), time_budget_s=5)
    new, metrics = par(state, batch)
    ref_new, ref_metrics = jax.jit(step)(state, batch)
    assert global_rel_error(ref_metrics["loss"], metrics["loss"]) <= TOL
    assert global_rel_error(ref_new["w"], new["w"]) <= TOL
    assert (jax.random.key_data(new["key"]) == jax.random.key_data(ref_new["key"])).all()
    assert "predicted step time" in par.explain()


# ---- surprises that now warn or refuse ----------------------------------------------------------------------------


def test_budgets_that_cannot_be_meant_are_refused() -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=True)
    for bad in (0, -5, float("inf"), float("nan")):
        with pytest.raises(PlanningError, match="positive, finite number of seconds"):
            autoshard.plan(ex.train_step, *ex.args, mesh=(8,), time_budget_s=bad)
    with pytest.raises(PlanningError, match="microbatches=0"):
        autoshard.plan(ex.train_step, *ex.args, mesh=(8,), microbatches=0)
    with pytest.raises(PlanningError, match="optional unit"):
        Target.of((8,), "h100", "80 furlongs")
    for flag in (["--time-budget", "inf"], ["--time-budget", "0"], ["--microbatches", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["plan", str(ROOT / "examples" / "mlp.py"), *flag])
        assert e.value.code == 2


def test_memory_budgets_take_units() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("16e9") == 16e9 and parse_bytes("512 MB") == 512e6
    assert Target.of((8,), "h100", "8GiB").memory_budget == 8 * 2**30


def test_a_batch_no_mesh_axis_divides_is_named_in_a_warning(caplog) -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", ["batch=7"], abstract=True)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), time_budget_s=3)
    assert "has 7 rows, which no mesh axis (sizes 2, 4) divides" in caplog.text


def test_a_python_int_in_the_state_does_not_plan_again() -> None:
    ex = _mlp()
    state, batch = ex.args
    state = state.replace(step=0)  # as TrainState.create leaves it: a Python int

    par = autoshard.parallelize(ex.train_step, mesh=(8,), time_budget_s=5)
    state, _ = par(state, batch)
    state, _ = par(state, batch)
    assert len(par._cache) == 1


# ---- progress and saved plans -------------------------------------------------------------------------------------


def test_planning_reports_its_progress_at_info(caplog) -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=True)
    with caplog.at_level(logging.INFO, logger="autoshard"):
        plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), time_budget_s=3)
    for phase in ("traced the step", "built the problem", "planned"):
        assert phase in caplog.text
    assert plan.solver.trace_seconds is not None and plan.solver.seed_seconds >= 0


def test_a_saved_plan_runs_without_planning_again(tmp_path: Path, caplog) -> None:
    ex = _mlp()
    first = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=5)
    first(*ex.args)
    path = tmp_path / "plan.json"
    first.plan.save(path)
    again = autoshard.parallelize(ex.train_step, mesh=(2, 4), plan=path)
    with caplog.at_level(logging.INFO, logger="autoshard"):
        _matches_jit(ex.train_step, _mlp().args, again)
    assert "built the problem" not in caplog.text
    assert again.plan.to_dict() == first.plan.to_dict()
    wrong = autoshard.parallelize(ex.train_step, mesh=(8,), plan=path)
    with pytest.raises(PlanningError, match="made for the mesh"):
        wrong(*_mlp().args)


def test_does_not_fit_says_which_recompute_setting_would() -> None:
    from autoshard.planner.plan import DoesNotFit

    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", abstract=True)
    with pytest.raises(DoesNotFit) as caught:
        autoshard.plan(ex.train_step, *ex.args, mesh=(2,), memory_budget=2e5, time_budget_s=3)
    message = str(caught.value)
    # what each recompute setting needs, that pipelines were tried, and what to do next
    assert re.search(r"as traced at least [\d.]+ GB, with selective recompute at least [\d.]+ GB, "
                     r"with full recompute at least [\d.]+ GB", message), message
    assert "microbatches" in message and "does not fit" in message.split("pipeline:")[1], message
    assert "stage_time" not in message, message  # the user's terms, not the stage DP's
    assert caught.value.needed is not None and caught.value.needed > 2e5


def test_a_pipeline_for_a_mesh_across_hosts_is_planned_for_the_program_that_runs_there() -> None:
    """One process drives one host's devices, so the MPMD runtime (every stage's programs dispatched from
    one process) runs only inside a host: ``runtime="auto"`` plans a pipeline for the SPMD program when the
    mesh spans hosts (8x8 H100: eight hosts) or several processes run; ``spmd``/``mpmd`` are kept as asked."""
    from autoshard.target import runs_spmd, uniform_stages

    one_host, hosts = Target.of((2, 4), "h100"), Target.of((8, 8), "h100")
    assert not one_host.spans_hosts and hosts.spans_hosts
    assert not uniform_stages("auto", one_host) and uniform_stages("auto", one_host, processes=2)
    assert uniform_stages("auto", hosts) and not uniform_stages("mpmd", hosts) and uniform_stages("spmd", one_host)
    with pytest.raises(PlanningError, match=r"runtime='threads'.*auto, spmd, mpmd"):
        uniform_stages("threads", hosts)
    # and at run time a plan runs where it was priced: "auto" follows the plan (several processes: SPMD)
    assert runs_spmd("auto", True) and not runs_spmd("auto", False) and runs_spmd("auto", False, processes=2)
    assert runs_spmd("spmd", False) and not runs_spmd("mpmd", True)
    with pytest.raises(PlanningError, match=r"runtime='threads'"):
        runs_spmd("threads", True)
