"""Megatron-style pipelined layouts priced beside the automatic plan (``autoshard.megatron``, issue #14)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from autoshard._examples import load_example
from autoshard.megatron import default_stage_shapes, grid_table, megatron_grid
from autoshard.pipeline import PipelinePlan
from autoshard.target import Target

ROOT = Path(__file__).resolve().parents[1]


def test_default_stage_shapes_are_a_host_half_a_host_and_two_hosts() -> None:
    assert default_stage_shapes((8, 8)) == [(1, 8), (1, 4), (2, 8)]
    assert default_stage_shapes((8,)) == [(1, 8), (1, 4)]
    assert default_stage_shapes((3, 6)) == [(1, 6), (1, 3)]


def test_each_grid_point_is_the_pipeline_pinned_to_its_layout() -> None:
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=True)
    target = Target.of("2x4", "h100", "auto")
    points = megatron_grid(ex.train_step, ex.args, target, stage_shapes=[(1, 4), (1, 3)], microbatches=[4],
                           recompute=["none"], time_budget_s=5)
    assert [(p.stage_shape, p.microbatches, p.recompute) for p in points] == [((1, 4), 4, "none"), ((1, 3), 4, "none")]
    fits, odd = points
    assert isinstance(fits.plan, PipelinePlan) and fits.error is None
    assert {s.submesh for s in fits.plan.stages} == {(1, 4)}
    assert fits.plan.num_microbatches == 4
    # 3-device stages cannot tile 2 hosts of 4: a row with the planner's reason, not a crash
    assert odd.plan is None and odd.error and "3" in odd.error
    table = grid_table(points)
    assert "stage 1x4, B=4, 1f1b, recompute none" in table and "best grid point: stage 1x4" in table
    # the SP column: the share of the stages' norms laid out along the sequence (GPT has 2 per block + ln_f)
    assert fits.sequence_parallel is not None and 0.0 <= fits.sequence_parallel <= 1.0
    assert odd.sequence_parallel is None and "| SP |" in table


def test_compare_megatron_prints_the_automatic_plan_beside_the_grid(tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    proc = subprocess.run(
        [sys.executable, "-m", "autoshard.cli", "compare", str(ROOT / "examples" / "gpt.py"), "--preset", "tiny",
         "--mesh", "2x4", "--megatron", "--stage-shapes", "1x4", "--microbatches", "4", "--recompute", "none",
         "--time-budget", "5", "-q", "--json", str(out)],
        capture_output=True, text=True, check=False, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "| automatic |" in proc.stdout and "automatic / best =" in proc.stdout
    data = json.loads(out.read_text())
    assert data["automatic"]["step_time"] > 0 and 0.0 <= data["automatic"]["sequence_parallel"] <= 1.0
    assert [row["stage_shape"] for row in data["grid"]] == [[1, 4]] and data["grid"][0]["step_time"] > 0


def test_the_grid_is_priced_for_the_runtime_the_automatic_plan_is() -> None:
    # a hand layout priced for the MPMD runtime against an automatic plan priced for the SPMD program's
    # lockstep ticks compared two runtimes (GPT-1T's Megatron 2022 layout at 80 GB: 80.4 s against 100.9 s)
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [], abstract=True)
    target = Target.of("2x4", "h100", "auto")
    for runtime, spmd in (("spmd", True), ("mpmd", False)):
        (point,) = megatron_grid(ex.train_step, ex.args, target, stage_shapes=[(1, 4)], microbatches=[4],
                                 recompute=["none"], time_budget_s=5, runtime=runtime)
        assert isinstance(point.plan, PipelinePlan) and point.plan.spmd == spmd
        assert (point.plan.host_time > 0) == (not spmd)  # the MPMD runtime's host work, priced
