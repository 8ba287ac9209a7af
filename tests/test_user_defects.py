"""Defects a new user hit (issue 32, item 5): explaining a plan that recomputes, comparing layouts on a step
that fits only with recompute, a saved plan run on a step of other shapes or on a same-shape mesh with other
axis names, a batch leaf that is no array, and a first call whose emission and compilation logged nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.api import _on_mesh
from autoshard.cli import build_parser, main
from autoshard.emit import emit, global_rel_error
from autoshard.errors import TraceError
from autoshard.pipeline import PipelinePlan, microbatch_args
from autoshard.planner import layouts
from autoshard.planner.compare import compare
from autoshard.planner.plan import Plan, PlanError
from autoshard.target import PlanningError
from autoshard.trace import remat
from cost_models import CostModel

ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "gpt.py")
MLP = str(ROOT / "examples" / "mlp.py")
TOL = 1e-5


def _example(path: str, overrides: tuple[str, ...] = (), *, abstract: bool = True):
    return load_example(path, "tiny", list(overrides), abstract=abstract)


@pytest.fixture(scope="module")
def mlp():
    """The tiny MLP with real arrays, built once (parallelize copies the state it donates, so the arrays
    stay valid from test to test)."""
    return _example(MLP, abstract=False)


# ---- 1. explain --why on a plan that recomputes ----------------------------------------------------------


def test_explain_why_on_a_plan_that_recomputes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The plan's layouts are of the step with its recompute applied: explain traces the model that way
    (it used to trace it as written and fail on the replayed ops' layouts: "sharding spec R·R·R·R has 4
    dimensions but the tensor has shape ()")."""
    ex = _example(GPT)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2,), recompute="selective", time_budget_s=3)
    assert isinstance(plan, Plan) and set(plan.recompute.values()) == {"selective"}
    path = tmp_path / "plan.json"
    plan.save(path)
    rc = main(["explain", str(path), "--graph", GPT, "--why", "state.params.block_0.mlp.fc.kernel"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "state.params.block_0.mlp.fc.kernel" in captured.out
    assert "the rebuilt problem prices this plan" not in captured.out  # the graph is the one planned
    # a model of other shapes is refused, naming what differs
    rc = main(["explain", str(path), "--graph", GPT, "--set", "hidden=128", "--why", "state.params.wpe.embedding"])
    err = capsys.readouterr().err
    assert rc == 2 and "state.params.block_0.attn.proj.bias: planned float32[64], given float32[128]" in err
    assert "Plan again" in err


def test_explain_checks_a_pipelined_plan_against_its_model(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A pipelined plan is checked against the model at microbatch size with its recompute applied."""
    ex = _example(GPT)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2,), microbatches=2, pipeline=True,
                          recompute="selective", time_budget_s=3)
    assert isinstance(plan, PipelinePlan) and plan.recompute
    path = tmp_path / "pipe.json"
    plan.save(path)
    assert main(["explain", str(path), "--graph", GPT]) == 0
    capsys.readouterr()
    assert main(["explain", str(path), "--graph", GPT, "--set", "batch=16"]) == 2
    err = capsys.readouterr().err
    assert "batch.tokens: planned int32[4, 33], given int32[8, 33]" in err and "2 microbatches" in err


# ---- 2. compare on a step that fits only with recompute --------------------------------------------------


def test_compare_plans_with_recompute_when_the_step_fits_only_so() -> None:
    """Tiny GPT on 8 devices in 600 kB: no layout fits as traced (it needs at least 601 kB), selective
    recompute does. compare used to raise DoesNotFit; now the automatic plan recomputes and the hand
    layouts are priced on the same rewritten step."""
    ex = _example(GPT)
    graph = autoshard.trace(ex.train_step, *ex.args)
    cost = CostModel.load("h100", mesh_shape=(8,), axis_names=("x",))
    zero3 = layouts.zero(graph, cost.mesh, 3)
    result = compare(graph, cost, layouts=[zero3], hardware="h100", memory_budget=6e5, time_budget_s=2,
                     seeded=False)
    assert set(result.auto.recompute.values()) == {"selective"} and result.auto.peak_memory <= 6e5
    (priced,) = result.priced
    assert dict(priced.plan.recompute) == dict(result.auto.recompute)
    # the hand layout was priced on the rewritten step: its plan holds the replayed ops' layouts
    assert len(priced.plan.specs[()]) == len(result.auto.specs[()])
    text = result.text()
    assert f"recompute: {remat.summary(result.auto.recompute)}" in text and "dp(x) zero3" in text


def test_compare_accepts_every_recompute_setting_the_messages_name(capsys: pytest.CaptureFixture[str]) -> None:
    """The DoesNotFit message says "--recompute auto, the default, tries it": plan and compare take it
    (compare refused it as an invalid choice); --megatron still takes a list of settings."""
    parser = build_parser()
    for cmd in ("plan", "compare"):
        assert parser.parse_args([cmd, MLP, "--recompute", "auto"]).recompute in ("auto", ["auto"])
    megatron = parser.parse_args(["compare", MLP, "--megatron", "--recompute", "none", "full"])
    assert megatron.recompute == ["none", "full"]
    assert main(["compare", MLP, "--recompute", "none", "full", "-q"]) == 2
    assert "compare prices every layout at one recompute setting" in capsys.readouterr().err
    rc = main(["compare", MLP, "--mesh", "2", "--recompute", "auto", "--time-budget", "1", "-q"])
    out = capsys.readouterr().out
    assert rc == 0 and "dp(x)" in out and "recompute:" not in out  # fits as traced: nothing recomputed


# ---- 3. a saved plan on a step of other shapes -----------------------------------------------------------


def test_a_plan_run_on_a_step_of_other_shapes_is_refused(tmp_path: Path) -> None:
    """Same parameter names, hidden 128 against the plan's 64: refused before anything runs, naming the
    first leaves that differ (the plan ran silently with layouts and prices made for other shapes)."""
    ex = _example(MLP)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), time_budget_s=2)
    path = tmp_path / "plan.json"
    plan.save(path)
    big = _example(MLP, ("hidden=128",), abstract=False)
    step = autoshard.parallelize(big.train_step, mesh=(2, 4), plan=path)
    with pytest.raises(PlanError) as e:
        step(*big.args)
    message = str(e.value)
    assert "state.params.dense_0.kernel: planned float32[32, 64], given float32[32, 128]" in message
    assert "of its 22 input leaves differ" in message and "Plan again for this step" in message
    # a batch of another dtype too
    ex = _example(MLP)
    state, batch = ex.args
    other = dict(batch, x=jax.ShapeDtypeStruct(batch["x"].shape, jnp.bfloat16))
    with pytest.raises(PlanError, match=r"batch.x: planned float32\[16, 32\], given bfloat16\[16, 32\]"):
        plan.verify(autoshard.trace(ex.train_step, state, other))


def test_a_pipelined_plan_names_the_inputs_of_other_shapes(tmp_path: Path) -> None:
    ex = _example(GPT)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2,), microbatches=2, pipeline=True, time_budget_s=3)
    assert isinstance(plan, PipelinePlan)
    path = tmp_path / "pipe.json"
    plan.save(path)
    again = PipelinePlan.load(path)
    assert again.inputs == plan.inputs and ("batch.tokens", (4, 33), "int32") in plan.inputs

    def micro(overrides: tuple[str, ...]):
        e = _example(GPT, overrides)
        return autoshard.trace(e.train_step, *microbatch_args(e.args, autoshard.trace(e.train_step, *e.args),
                                                              None, 2))

    again.verify(micro(()))
    with pytest.raises(PlanError) as e:
        again.verify(micro(("hidden=128",)))
    assert "state.params.block_0.attn.proj.bias: planned float32[64], given float32[128]" in str(e.value)
    assert "microbatch size" in str(e.value) and "Plan again" in str(e.value)


# ---- 4. a saved plan on a same-shape mesh with other axis names ------------------------------------------


def test_a_saved_plan_runs_on_a_same_shape_mesh_with_other_axis_names(mlp, tmp_path: Path) -> None:
    """A plan for ``x=2, y=4`` runs on ``jax.make_mesh((2, 4), ("data", "model"))``, its axes matched by
    position, and computes what jax.jit computes (it was refused)."""
    plan = autoshard.plan(mlp.train_step, *mlp.args, mesh=(2, 4), hardware="cpu", time_budget_s=3)
    assert isinstance(plan, Plan) and plan.mesh.axis_names == ("x", "y")
    path = tmp_path / "plan.json"
    plan.save(path)
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    step = autoshard.parallelize(mlp.train_step, mesh=mesh, plan=path)
    ref = jax.jit(mlp.train_step)
    s_ref, batch = mlp.args
    s_par = s_ref
    for _ in range(2):
        s_ref, m_ref = ref(s_ref, batch)
        s_par, m_par = step(s_par, batch)
        assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
        assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL
    assert step.plan.mesh.axis_names == ("data", "model")
    assert {a for t in step.plan.inputs for d in t.spec.dims for a in d} <= {"data", "model"}
    assert s_par.params["dense_0"]["kernel"].sharding.mesh.axis_names == ("data", "model")
    # the layouts are the saved plan's, renamed
    saved = Plan.load(path)
    renamed = {t.name: str(t.spec).replace("data", "x").replace("model", "y") for t in step.plan.inputs}
    assert renamed == {t.name: str(t.spec) for t in saved.inputs}
    assert step.plan.predicted_step_time == saved.predicted_step_time


def test_a_mesh_that_cannot_be_matched_by_position_is_refused_with_a_correct_hint() -> None:
    ex = _example(MLP)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh={"x": 2, "y": 4}, time_budget_s=2)
    devices = np.array(jax.devices()[:8])
    assert _on_mesh(plan, jax.sharding.Mesh(devices.reshape(4, 2), ("y", "x"))) is plan  # same axes by name
    with pytest.raises(PlanningError, match=r"a jax Mesh of shape \(2, 4\) \(its axes are matched to the plan's by "
                                            r"position\)"):
        _on_mesh(plan, jax.sharding.Mesh(devices.reshape(4, 2), ("data", "model")))
    with pytest.raises(PlanningError, match="names its axis 'y' after another of the plan's axes"):
        _on_mesh(plan, jax.sharding.Mesh(devices.reshape(2, 4), ("y", "x")))


# ---- 5. a leaf that is no array --------------------------------------------------------------------------


@pytest.mark.parametrize("leaf", ["wikitext", print, object()], ids=["str", "function", "object"])
def test_a_leaf_that_is_no_array_names_its_path(mlp, leaf: object) -> None:
    """It crashed in the cache key with "TypeError: Cannot determine dtype of ..." (a string named like a
    dtype, "float32", would even pass there)."""
    state, batch = mlp.args
    step = autoshard.parallelize(mlp.train_step, mesh=(2, 4), time_budget_s=2)
    with pytest.raises(TraceError) as e:
        step(state, dict(batch, name=leaf))
    message = str(e.value)
    assert message.startswith(f"argument batch.name is a {type(leaf).__name__} (")
    assert "arrays (jax or numpy) or Python numbers" in message and "static field" in message
    assert "functools.partial" in message


def test_a_leaf_that_is_no_array_after_the_first_call_is_named_too(mlp) -> None:
    """The steady state's fast path hands such a call to the checked path instead of failing in jax.jit."""
    state, batch = mlp.args
    step = autoshard.parallelize(mlp.train_step, mesh=(2, 4), time_budget_s=2)
    step(state, dict(batch, name=jnp.zeros(())))
    with pytest.raises(TraceError, match=r"argument batch\.name is a str"):
        step(state, dict(batch, name="float32"))


# ---- 6. the first call's emission and compilation are logged ---------------------------------------------


def test_the_first_call_logs_emission_and_compilation(mlp, caplog: pytest.LogCaptureFixture) -> None:
    step = autoshard.parallelize(mlp.train_step, mesh=(2, 4), time_budget_s=2)
    with caplog.at_level(logging.INFO, logger="autoshard"):
        state, _ = step(*mlp.args)
    messages = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("emitted the step in ") for m in messages) == 1
    assert sum(m.startswith("compiled the step in ") for m in messages) == 1
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="autoshard"):
        step(state, mlp.args[1])
    assert "emitted" not in caplog.text and "compiled" not in caplog.text


def test_the_program_compiled_ahead_is_the_one_the_first_call_runs(mlp) -> None:
    """Lowering and compiling ahead (to time them) costs nothing: jax.jit reuses that executable."""
    graph = autoshard.trace(mlp.train_step, *mlp.args)
    program = emit(graph, {}, jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",)))
    args = program.place(*mlp.args)
    compiles: list[str] = []

    def listen(event: str, seconds: float, **kw: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        program(*args)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(compiles) == 1
