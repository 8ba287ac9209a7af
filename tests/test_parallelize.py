"""``@autoshard.parallelize`` end to end on the 8 CPU devices: the planned, emitted step computes what the
unsharded step computes (loss and Adam moments, one global relative norm, float32, 1e-5)."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.emit.program import ArgumentMismatch

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _compare(path: str, mesh, overrides=(), steps: int = 3):
    ex = load_example(ROOT / "examples" / path, "tiny", list(overrides), abstract=False)
    ref = jax.jit(ex.train_step)
    par = autoshard.parallelize(ex.train_step, mesh=mesh, time_budget_s=10)
    s_ref, batch = ex.args
    s_par = s_ref
    for _ in range(steps):
        s_ref, m_ref = ref(s_ref, batch)
        s_par, m_par = par(s_par, batch)
        assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
        assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL
    return par


@pytest.mark.parametrize("mesh", [(8,), (2, 4), (4, 2)], ids=lambda m: "x".join(map(str, m)))
def test_mlp_matches_the_unsharded_step(mesh) -> None:
    par = _compare("mlp.py", mesh)
    assert par.plan.mesh.shape == mesh
    assert "predicted step time" in par.explain()


def test_gpt_matches_the_unsharded_step() -> None:
    _compare("gpt.py", (2, 4))


@pytest.mark.slow
@pytest.mark.parametrize("path", ["gpt.py", "moe.py", "wide_resnet.py"])
@pytest.mark.parametrize("mesh", [(8,), (2, 4), (4, 2)], ids=lambda m: "x".join(map(str, m)))
def test_examples_match_the_unsharded_step(path: str, mesh) -> None:
    _compare(path, mesh)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [["scan_layers=true"], ["scan_layers=true", "remat=true"], ["remat=true"]])
def test_gpt_scan_and_remat_match_the_unsharded_step(overrides: list[str]) -> None:
    _compare("gpt.py", (2, 4), overrides)


def test_second_call_reuses_the_compiled_program() -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=False)
    par = autoshard.parallelize(mesh=(8,), time_budget_s=10)(ex.train_step)
    state, batch = ex.args
    state, _ = par(state, batch)
    first = par.plan
    state, _ = par(state, batch)
    assert par.plan is first


def test_a_batch_of_another_shape_is_planned_again_and_the_first_program_kept() -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=False)
    rows = ex.args[1]["x"].shape[0]
    other = load_example(ROOT / "examples" / "mlp.py", "tiny", [f"batch={2 * rows}"], abstract=False).args[1]
    par = autoshard.parallelize(ex.train_step, mesh=(8,), time_budget_s=10)
    ref = jax.jit(ex.train_step)
    s_ref = s_par = ex.args[0]
    plans = []
    for batch in (ex.args[1], ex.args[1], other, ex.args[1]):
        s_ref, m_ref = ref(s_ref, batch)
        s_par, m_par = par(s_par, batch)
        assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
        plans.append(par.plan)
    assert plans[0] is plans[1] is plans[3] and plans[2] is not plans[0] and len(par._cache) == 2
    # the emitted program itself refuses leaves of other shapes, naming the leaf
    with pytest.raises(ArgumentMismatch, match=rf"argument leaf \d+ \(batch.x\) is float32\[{2 * rows}, "):
        par._last.step(s_par, other)


def test_mesh_larger_than_the_devices_is_a_clear_error() -> None:
    ex = load_example(ROOT / "examples" / "mlp.py", "tiny", abstract=False)
    par = autoshard.parallelize(ex.train_step, mesh=(4, 4))
    with pytest.raises(autoshard.target.PlanningError, match="needs 16 devices but 8 are present"):
        par(*ex.args)
