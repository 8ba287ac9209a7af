"""Recompute applied by the planner (``trace.remat``, ``planner.recompute``): the rewritten step keeps its
numerics, holds less memory, costs more compute, and ``recompute="auto"`` turns it on only when the step
does not fit without it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_module
from autoshard.cli import main as cli_main
from autoshard.emit import global_rel_error
from autoshard.errors import AutoshardError
from autoshard.planner.plan import DoesNotFit, Plan, PlanError
from autoshard.planner.recompute import plan_recomputing
from autoshard.target import cost_model_for
from autoshard.trace import Graph
from autoshard.trace.buffers import buffers
from autoshard.trace.remat import blocks, rematerialize, uniform

ROOT = Path(__file__).resolve().parents[1]
GPT = ROOT / "examples" / "gpt.py"
SMALL = {"layers": 4, "batch": 16, "seq_len": 64}
TOL = 1e-5
STEPS = 3


@functools.cache
def _gpt(concrete: bool = False) -> tuple[Any, Graph, tuple[Any, ...]]:
    mod = load_module(GPT)
    if concrete:
        args = jax.jit(lambda: mod.make("tiny", **SMALL))()
    else:
        args = mod.make("tiny", abstract=True, **SMALL)
    return mod.train_step, autoshard.trace(mod.train_step, *args), args


def test_recompute_shortens_live_ranges_and_adds_forward_work() -> None:
    _, graph, _ = _gpt()
    assert len(blocks(graph)) == 4
    peaks, flops = {}, {}
    for mode in ("none", "selective", "full"):
        g = rematerialize(graph, uniform(graph, mode))
        peaks[mode], flops[mode] = buffers(g).peak(g), g.total_flops
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    assert flops["none"] < flops["selective"] < flops["full"]
    # selective replays the elementwise ops only; full replays the matmuls as well (a third more work or so)
    assert flops["selective"] - flops["none"] < 0.1 * (flops["full"] - flops["none"])
    assert rematerialize(graph, {}) is graph


def test_unknown_mode_or_setting_is_refused() -> None:
    _, graph, _ = _gpt()
    with pytest.raises(AutoshardError, match=r"recompute mode 'some'.*none, selective, full"):
        rematerialize(graph, {blocks(graph)[0]: "some"})
    with pytest.raises(PlanError, match=r"recompute='sometimes'.*auto"):
        autoshard.plan(graph, mesh=(2,), recompute="sometimes")


def test_auto_recomputes_only_when_the_step_does_not_fit() -> None:
    _, graph, _ = _gpt()
    cost = cost_model_for("h100", (1,), ("x",))
    kw: dict[str, Any] = {"hardware": "h100", "time_budget_s": 10}
    roomy, same = plan_recomputing(graph, cost, memory_budget=None, **kw)
    assert same is graph and not roomy.recompute
    full, _ = plan_recomputing(graph, cost, recompute="full", memory_budget=None, **kw)
    sel, _ = plan_recomputing(graph, cost, recompute="selective", memory_budget=None, **kw)
    assert full.peak_memory < sel.peak_memory < roomy.peak_memory
    assert roomy.predicted_step_time < sel.predicted_step_time < full.predicted_step_time
    # a budget between selective's peak and the step's: auto chooses selective, on every block
    tight, rewritten = plan_recomputing(graph, cost, memory_budget=(sel.peak_memory + roomy.peak_memory) / 2, **kw)
    assert set(tight.recompute.values()) == {"selective"} and len(tight.recompute) == 4
    assert rewritten is not graph and tight.peak_memory < roomy.peak_memory
    # between full's and selective's: full
    tighter, _ = plan_recomputing(graph, cost, memory_budget=(full.peak_memory + sel.peak_memory) / 2, **kw)
    assert set(tighter.recompute.values()) == {"full"}
    # below full's: the error says what each setting needs
    with pytest.raises(DoesNotFit, match=r"recompute or not \(as traced at least .* GB, with selective "
                       r"recompute at least .* GB, with full recompute at least .* GB, of its 4 blocks\)") as e:
        plan_recomputing(graph, cost, memory_budget=0.5 * full.peak_memory, **kw)
    assert e.value.needed is not None and e.value.needed > 0.5 * full.peak_memory
    # recompute="none" never rewrites, even when it does not fit
    with pytest.raises(DoesNotFit):
        plan_recomputing(graph, cost, recompute="none", memory_budget=(sel.peak_memory + roomy.peak_memory) / 2,
                         **kw)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_parallelized_step_with_recompute_matches_jit(mode: str, tmp_path: Path) -> None:
    """The planner's recompute, applied by ``parallelize`` on a 2x4 mesh, computes the unsharded step's
    numbers over 3 steps (fp32 loss and Adam moments, rel err <= 1e-5); a saved plan keeps the choice and
    runs the same program again."""
    step, _, args = _gpt(concrete=True)
    ref = jax.jit(step)
    want = []
    state, batch = args
    for _ in range(STEPS):
        state, metrics = ref(state, batch)
        want.append((float(metrics["loss"]), state.opt_state))
    par = autoshard.parallelize(step, mesh=(2, 4), recompute=mode, time_budget_s=10)
    state, batch = args
    for want_loss, want_opt in want:
        state, metrics = par(state, batch)
        assert abs(float(metrics["loss"]) - want_loss) <= TOL * abs(want_loss)
        assert global_rel_error(want_opt, state.opt_state) <= TOL
    plan = par.plan
    assert isinstance(plan, Plan) and set(plan.recompute.values()) == {mode}
    plan.save(tmp_path / "plan.json")
    again = Plan.load(tmp_path / "plan.json")
    assert dict(again.recompute) == dict(plan.recompute)
    rerun = autoshard.parallelize(step, mesh=(2, 4), plan=again)
    state, metrics = rerun(*args)
    assert abs(float(metrics["loss"]) - want[0][0]) <= TOL * abs(want[0][0])
    assert global_rel_error(want[0][1], state.opt_state) <= TOL


def test_cli_recompute_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    rc = cli_main(["plan", str(GPT), "--mesh", "2", "--recompute", "full", "--time-budget", "10",
                   *[a for k, v in SMALL.items() for a in ("--set", f"{k}={v}")], "-o", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "recompute: full on 4 blocks" in text
    saved = json.loads(out.read_text())
    assert set(saved["recompute"].values()) == {"full"}
    assert np.isfinite(saved["predicted_step_time"])
