"""Defects a new user hit (issue 32, item 5): comparing layouts on a step that fits only with recompute, a
saved plan run on a step of other shapes, and a first call whose emission and compilation logged nothing."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.cli import build_parser, main
from autoshard.emit import emit
from autoshard.pipeline import PipelinePlan, microbatch_args
from autoshard.planner import layouts
from autoshard.planner.compare import compare
from autoshard.planner.plan import PlanError
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
    assert "recompute: selective on 2 blocks" in text and "dp(x) zero3" in text


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


# ---- 6. the first call's emission and compilation are logged ---------------------------------------------


def test_the_first_call_logs_emission_and_compilation(mlp, caplog: pytest.LogCaptureFixture) -> None:
    step = autoshard.parallelize(mlp.train_step, mesh=(2, 4), time_budget_s=2)
    with caplog.at_level(logging.INFO, logger="autoshard"):
        state, _ = step(*mlp.args)
    assert caplog.text.count("autoshard: emitted the step in ") == 1
    assert caplog.text.count("autoshard: compiled the step in ") == 1
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
