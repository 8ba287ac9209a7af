"""The planner's pipelines as one SPMD program (``autoshard.pipeline.spmd_program``): uniform stages cut
from the traced step, schedules as tick tables, the same numbers as ``jax.jit`` on one process and on two
(``jax.distributed``, 2 processes x 4 CPU devices, gloo)."""

from __future__ import annotations

import functools
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

import jax
import multiproc
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.emit.program import ArgumentMismatch
from autoshard.pipeline.partition import PipelineError, microbatch_args, trace_microbatch
from autoshard.pipeline.schedules import schedule
from autoshard.pipeline.spmd_program import SpmdPipelineStep, stage_mesh
from autoshard.pipeline.ticks import fused_1f1b, fused_inflight, lockstep_tables, price, ticks
from autoshard.pipeline.uniform import uniform_stages
from autoshard.trace import trace
from autoshard.trace.structure import structure

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
from pipeline_forms import make  # noqa: E402

TOL = 1e-5


def _matches_jit(step: object, fn: object, state: object, batch: object, steps: int = 3) -> object:
    """Run ``step`` and ``jax.jit(fn)`` ``steps`` times from ``state``: equal losses every step and equal final
    state (relative error <= TOL); returns jax.jit's final state."""
    want, got = jax.tree.map(lambda x: np.array(x), state), state
    for _ in range(steps):
        got, m1 = step(got, batch)
        want, m2 = jax.jit(fn)(want, batch)
        assert global_rel_error(m2["loss"], m1["loss"]) <= TOL
    assert global_rel_error(jax.tree.leaves(want), jax.tree.leaves(got)) <= TOL
    return want


def _micro(layers: int = 4, micro: int = 4, **overrides: object):
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [f"layers={layers}"] +
                      [f"{k}={v}" for k, v in overrides.items()], abstract=True)
    full = trace(ex.train_step, *ex.args)
    return trace_microbatch(ex.train_step, ex.args, full, micro), full


@pytest.mark.parametrize("stages", [2, 4])
def test_uniform_stages_stack_the_blocks_and_keep_head_and_tail_apart(stages: int) -> None:
    micro, _ = _micro()
    cut = uniform_stages(micro, stages)
    assert cut.num_stages == stages and len(cut.blocks) == 4
    assert len({len(g.ops) for g in cut.chunk_f}) == 1 and len({len(g.ops) for g in cut.chunk_b}) == 1
    # one stream between stages (the residual), its cotangent back; each block's weights stacked per stage
    assert [k for k in cut.f_kinds if k.startswith("act")] == ["act:0"]
    assert len(cut.cot_out) == 1
    assert cut.f_kinds.count("stacked") == 12 * (4 // stages)  # 12 weights a block, 4 / S blocks a stage
    # every microbatched op is in exactly one group; the tied embedding's two gradient parts meet after
    groups = [cut.pre, cut.head_f, cut.head_b, cut.tail_f, cut.tail_b, cut.post, *cut.chunk_f, *cut.chunk_b]
    ops = [i for g in groups for i in g.ops]
    assert len(ops) == len(set(ops)) == len(micro.ops) - len(cut.update.ops)
    assert [micro.ops[i].primitive for i in cut.post.ops] == ["add_any"]


def test_stages_that_cannot_be_uniform_are_refused_with_what_to_change() -> None:
    micro, _ = _micro()
    with pytest.raises(PipelineError, match=r"4 repeated blocks .* 3 stages cannot share evenly; use a stage count"):
        uniform_stages(micro, 3)
    # a layer stack written as one scan, not unrolled (``trace_microbatch`` unrolls it; a graph traced
    # otherwise reaches the cut whole)
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", "scan_layers=true"], abstract=True)
    scanned = trace(ex.train_step, *microbatch_args(ex.args, trace(ex.train_step, *ex.args), None, 4))
    with pytest.raises(PipelineError, match="one scan"):
        uniform_stages(scanned, 2)


@pytest.mark.parametrize("name,stages,micro,chunks", [("1f1b", 4, 8, 1), ("1f1b", 2, 16, 1), ("gpipe", 4, 8, 1),
                                                        ("gpipe", 3, 5, 1), ("interleaved-1f1b", 2, 4, 2),
                                                        ("interleaved-1f1b", 4, 8, 2), ("fused", 4, 8, 1),
                                                        ("fused", 3, 2, 1), ("zb-h1", 4, 8, 1), ("zb-h1", 3, 5, 1)])
@pytest.mark.parametrize("split", [1, 2])
def test_tick_tables_follow_the_schedule_in_buffers_it_bounds(name: str, stages: int, micro: int, chunks: int,
                                                              split: int) -> None:
    gap = int(split > 1)  # a spread tail: a tick between the last stage's forward and backward
    if name == "fused":
        t = fused_1f1b(stages, micro, split)
        assert t.num_ticks == micro + 2 * stages - 2 + 2 * gap
        # stage s holds 2(S-1-s)+1 microbatches in flight: the rule the planner checks memory with
        assert [t.res_slots_at(s) for s in range(stages)] == list(fused_inflight(stages, micro, split))[::-1]
    else:
        sched = schedule(name, stages, micro, chunks, tail_gap=gap)
        t = ticks(sched, split)
        assert t.num_ticks == len(sched.slots)
        # residual slots: the schedule's peak in flight, not the microbatch count (for 1F1B)
        assert t.res_slots == max(sched.peak_inflight(s) for s in range(stages))
        if name in ("1f1b", "zb-h1"):  # ZB-H1 holds residuals until W, as many microbatches as 1F1B
            assert t.res_slots == min(stages + (gap if name == "1f1b" else 0), micro)
        assert t.weight_pass == (name == "zb-h1")
    assert t.spread == (split > 1)
    # replay the tables: every read finds the value written for the same (virtual stage, microbatch), never
    # overwritten in between; within a tick a stage runs its forward, then its backward, then its weight
    # pass; the stream goes round the ring between chunks; a spread tail runs the tick after the last
    # forward and its cotangent reaches the last stage at the end of that tick
    V = stages * chunks
    act, cot, res, kept = {}, {}, {}, {}
    done = set()
    tail_due: dict[int, int] = {}
    for k in range(t.num_ticks):
        sent_act, sent_cot = {}, {}
        if t.spread:
            assert int(t.tail_micro[k]) == tail_due.pop(k, -1)
        for s in range(stages):
            if t.f_micro[k, s] >= 0:
                m, u = int(t.f_micro[k, s]), int(t.f_chunk[k, s]) * stages + s
                if u > 0:
                    assert act[(s, int(t.act_read[k, s]))] == (u, m)
                res[(s, int(t.res_write[k, s]))] = (u, m)
                if u == V - 1 and t.spread:
                    assert t.cot_self[k, s] < 0
                    tail_due[k + 1] = m
                elif u == V - 1:
                    cot[(s, int(t.cot_self[k, s]))] = (u, m)
                else:
                    sent_act[(s + 1) % stages] = (u + 1, m)
                done.add(("F", u, m))
            if t.b_micro[k, s] >= 0:
                m, u = int(t.b_micro[k, s]), int(t.b_chunk[k, s]) * stages + s
                assert res[(s, int(t.res_read[k, s]))] == (u, m)
                assert cot[(s, int(t.cot_read[k, s]))] == (u, m)
                if u > 0:
                    sent_cot[(s - 1) % stages] = (u - 1, m)
                if t.weight_pass:
                    kept[(s, int(t.g_write[k, s]))] = (u, m)
                done.add(("B", u, m))
            if t.weight_pass and t.w_micro[k, s] >= 0:  # W reads what F, B and the stage after left it
                m, u = int(t.w_micro[k, s]), int(t.w_chunk[k, s]) * stages + s
                assert ("B", u, m) in done
                assert res[(s, int(t.w_res[k, s]))] == cot[(s, int(t.w_cot[k, s]))] == (u, m)
                assert kept[(s, int(t.g_read[k, s]))] == (u, m)
                done.add(("W", u, m))
        for s in range(stages):  # the end-of-tick exchange
            assert (t.act_recv[k, s] >= 0) == (s in sent_act) and (t.cot_recv[k, s] >= 0) == (s in sent_cot)
            if s in sent_act:
                act[(s, int(t.act_recv[k, s]))] = sent_act[s]
            if s in sent_cot:
                cot[(s, int(t.cot_recv[k, s]))] = sent_cot[s]
        if t.spread and t.tail_micro[k] >= 0:
            cot[((V - 1) % stages, int(t.tail_cot[k]))] = (V - 1, int(t.tail_micro[k]))
    assert done == {(kind, u, m) for kind in ("FBW" if t.weight_pass else "FB") for u in range(V)
                    for m in range(micro)}
    assert not tail_due


@pytest.mark.parametrize("form,name,shape,recompute", [
    pytest.param("optax", "1f1b", (1, 2), "auto", marks=pytest.mark.slow),  # 1F1B: the selective case below
    pytest.param("state", "gpipe", (1, 2), "auto", marks=pytest.mark.slow),  # GPipe: across processes, below
    pytest.param("state", "interleaved-1f1b", (1, 4), "auto", marks=pytest.mark.slow),  # the scan case below
    ("state", "1f1b", (1, 2), "selective"),
    pytest.param("optax", "zb-h1", (1, 2), "auto", marks=pytest.mark.slow),  # ZB-H1: llama's, below
    pytest.param("state", "zb-v", (1, 4), "auto", marks=pytest.mark.slow),  # ZB-V: test_zb_v_... in CI
    ("state:scan", "interleaved-1f1b", (1, 4), "auto")])
def test_one_program_matches_jit(form: str, name: str, shape: tuple[int, int], recompute: str) -> None:
    fn, args, batch = make(form)
    want_args = jax.tree.map(lambda x: np.asarray(x).copy(), args)
    step = autoshard.parallelize(fn, mesh=(2, 4), microbatches=4, pipeline=True, schedule=name, stage_shape=shape,
                                 time_budget_s=8, runtime="spmd", recompute=recompute)
    ref = jax.jit(fn)
    got, want = list(args), list(want_args)
    got_l, want_l = [], []
    for i in range(3):
        fed = got
        *got, m1 = step(*got, batch)
        *want, m2 = ref(*want, batch)
        got_l.append(float(m1["loss"]))
        want_l.append(float(m2["loss"]))
        # the program donates the train state: the first call copies the caller's into its layouts, so those
        # outlive it; a later call, fed the step's own results, donates them, as jit does
        assert any(x.is_deleted() for x in jax.tree.leaves(fed)) == (i > 0)
    assert type(step._last.step).__name__ == "SpmdPipelineStep"
    # steady calls skip parallelize's signature (its fast path); the program refuses other shapes, by name
    half = jax.tree.map(lambda x: x[: x.shape[0] // 2], batch)
    with pytest.raises(ArgumentMismatch, match=r"argument leaf \d+ \(batch.tokens\) is int32\["):
        step._last.step(*got, half)
    assert step.plan.schedule == name and step.plan.num_physical_stages == 8 // (shape[0] * shape[1])
    assert step._last.step.num_chunks == (2 if name in ("interleaved-1f1b", "zb-v") else 1)
    # the plan priced the program as it runs: its lockstep ticks (interleaved too), one call a step
    priced = step._last.step.predicted
    assert step.plan.predicted_step_time == pytest.approx(priced.step - priced.dispatch, rel=1e-3)
    if recompute != "auto":  # each block replays in its stage's backward, inside the tick loop
        assert set(step.plan.recompute.values()) == {recompute} and len(step.plan.recompute) == 4
    if form.endswith(":scan"):  # the layer stack [4, ...] and its optimizer state: rows split over the stages
        prog = step._last.step
        stack = [s.spec for t, s in zip(prog.graph.inputs, prog.in_shardings, strict=True)
                 if ".blocks." in prog.graph.tensors[t].name]
        assert len(stack) == 36 and all(spec[0] == "stage" or spec[0][0] == "stage" for spec in stack)
    assert global_rel_error(np.array(want_l), np.array(got_l)) <= TOL
    assert global_rel_error(jax.tree.leaves(want), jax.tree.leaves(got)) <= TOL


@pytest.mark.parametrize("form,name", [
    # llama's and two styles' three schedules run across two processes in CI (the same program,
    # test_llama_and_models_in_two_styles_...), so here only with -m slow
    pytest.param("llama", "1f1b", marks=pytest.mark.slow), pytest.param("llama", "zb-h1", marks=pytest.mark.slow),
    pytest.param("llama", "interleaved-1f1b", marks=pytest.mark.slow),
    pytest.param("style:numbered", "1f1b", marks=pytest.mark.slow),
    pytest.param("style:numbered", "zb-h1", marks=pytest.mark.slow),
    pytest.param("style:numbered", "interleaved-1f1b", marks=pytest.mark.slow),
    pytest.param("style:unnumbered", "1f1b", marks=pytest.mark.slow),
    pytest.param("style:unnumbered", "zb-h1", marks=pytest.mark.slow),
    pytest.param("style:unnumbered", "interleaved-1f1b", marks=pytest.mark.slow),
    # ZB-V (two chunks a stage in a V): CI runs the tiny GPT's (test_zb_v_...), these with -m slow
    pytest.param("llama", "zb-v", marks=pytest.mark.slow), pytest.param("style:numbered", "zb-v", marks=pytest.mark.slow),
    pytest.param("style:flax_default", "1f1b", marks=pytest.mark.slow),
    pytest.param("style:nnx_list", "1f1b", marks=pytest.mark.slow)])
def test_models_written_as_users_write_them_run_as_one_program(form: str, name: str) -> None:
    """Blocks found by what they compute (``trace.structure``), not by a naming convention: Llama's
    ``layers/0`` with a padding mask made from the batch and RoPE tables read by every block (each stage
    makes the mask from its microbatch), ordinal names, GPT-2's ``h/0``; the program equals ``jax.jit``."""
    fn, args, batch = make(form)
    want_args = jax.tree.map(lambda x: np.asarray(x).copy(), args)
    shape = (1, 4) if name in ("interleaved-1f1b", "zb-v") else (1, 2)  # 2 stages x 2 chunks of a block
    step = autoshard.parallelize(fn, mesh=(2, 4), microbatches=4, pipeline=True, schedule=name, stage_shape=shape,
                                 time_budget_s=8, runtime="spmd")
    got, want = list(args), list(want_args)
    for _ in range(3):
        *got, m1 = step(*got, batch)
        *want, m2 = jax.jit(fn)(*want, batch)
        assert global_rel_error(m2["loss"], m1["loss"]) <= TOL
    assert global_rel_error(jax.tree.leaves(want), jax.tree.leaves(got)) <= TOL
    assert type(step._last.step).__name__ == "SpmdPipelineStep" and step.plan.schedule == name
    assert len(structure(step._last.step.micro).tags) == 4
    if name == "zb-v":  # the plan's stages in a V: stage 0 holds virtual stages 0 and 3
        plan = step.plan
        assert plan.num_chunks == 2 and plan.place(3) == (0, 1) and plan.stages[3].origin == plan.stages[0].origin


def _computations(hlo: str) -> dict[str, list[str]]:
    """The compiled module's computations: name -> their instruction lines."""
    comps: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            comps[name] = []
        elif name is not None and line.startswith(" "):
            comps[name].append(line)
    return comps


def _reached(comps: dict[str, list[str]], roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += re.findall(r"(?:calls|body|condition|to_apply|branch_computations)=\{?%?([\w.\-]+)", line)
            todo += re.findall(r"%([\w.\-]+)", "".join(re.findall(r"branch_computations=\{([^}]*)\}", line)))
    return seen


def test_the_program_exchanges_on_the_stage_axis_and_reduces_once() -> None:
    # 4 stages of one device: the loop's only collectives are the stage axis's collective-permutes; the
    # gradients are summed in the loop and reduced over the stage axis once, after it
    micro, full = _micro()
    from autoshard.pipeline.spmd_program import SpmdPipelineStep

    step = SpmdPipelineStep(micro, full, stage_mesh(jax.devices()[:4], 4), 4, "1f1b")
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4"], abstract=True)
    comps = _computations(step.lower(*ex.args).compile().as_text())
    bodies = {b for lines in comps.values() for line in lines for b in re.findall(r"body=%?([\w.\-]+)", line)}
    assert bodies, "no while loop in the compiled step"
    in_loop = _reached(comps, bodies)
    kinds = lambda names: {op for c in names for line in comps[c]  # noqa: E731
                           for op in re.findall(r"\b(all-reduce|all-gather|reduce-scatter|collective-permute|"
                                                r"all-to-all)(?:-start)?\(", line)}
    assert kinds(in_loop) == {"collective-permute"}
    assert "all-reduce" in kinds(set(comps) - in_loop)  # the head's and tail's gradients, once per step


def _data_parallel_stages(rows: int, M: int, layers: int) -> tuple[SpmdPipelineStep, Any, Any, Any]:
    """The tiny GPT's program of 2 stages x 4 devices, each stage data parallel over its microbatch's ``rows``
    (every batch and activation value split by rows over the stage's axes): layouts given, not planned.
    The step, the example's train step, its state and batch."""
    import dataclasses

    from autoshard.pipeline import plan_pipeline
    from autoshard.pipeline.spmd_program import spmd_pipeline_step
    from autoshard.target import cost_model_for
    from cost_models import ShardingSpec

    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [f"layers={layers}", f"batch={rows * M}"],
                      abstract=False)
    state, batch = ex.args
    full = trace(ex.train_step, state, batch)
    micro = trace(ex.train_step, *microbatch_args((state, batch), full, None, M))
    plan = plan_pipeline(micro, cost_model_for("h100", (2, 4), ("x", "y")), hardware="h100", num_microbatches=M,
                         time_budget_s=5, stage_shape=(1, 4), uniform=True, schedule_name="1f1b")

    def dp(axes: tuple[str, ...]) -> dict:
        return {(): {t.id: ShardingSpec(dims=(axes,) + ((),) * (len(t.shape) - 1)) for t in micro.tensors
                     if t.shape and t.shape[0] == rows and t.role.value in ("batch", "activation")}}

    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(st, specs=dp(tuple(st.mesh.axis_names)),
                                                                      update_specs={}) for st in plan.stages))
    return spmd_pipeline_step(micro, full, plan, jax.devices()), ex.train_step, state, batch


@pytest.mark.slow  # CI: the exchanges-and-one-reduction test below, on stages of one device
def test_data_parallel_stages_sum_their_gradients_in_the_loop_and_reduce_them_once() -> None:
    # 2 stages of 4 devices, each stage data parallel inside (every value with the microbatch's 8 rows split
    # over the stage's axes): each device's partial sums of the blocks', the tail's and the head's gradients
    # (the embeddings' too) are added up over the microbatches in the loop and reduced after it, once a step;
    # the numbers are jax.jit's
    step, train_step, state, batch = _data_parallel_stages(rows=8, M=4, layers=4)
    want = _matches_jit(step, train_step, state, batch)
    comps = _computations(step.lower(want, batch).compile().as_text())
    bodies = {b for lines in comps.values() for line in lines for b in re.findall(r"body=%?([\w.\-]+)", line)}
    in_loop = _reached(comps, bodies)
    reduced = lambda names: [shape for c in names for line in comps[c]  # noqa: E731
                             if (m := re.match(r"\s*%\S+ = (.*?) (?:all-reduce|reduce-scatter)(?:-start)?\(", line))
                             for shape in re.findall(r"\w+\[[\d,]*\]", m.group(1))]
    # nothing is reduced in the loop, the embeddings' gradients (scatter-adds into zeros) included
    assert not reduced(in_loop), reduced(in_loop)
    # a block's qkv kernel [64, 192]: its gradient, reduced after the loop (as the stage's [1, chunks, ...])
    assert any(re.fullmatch(r"f32\[(1,)*64,192\]", shape) for shape in reduced(set(comps) - in_loop))


def _stage_branch_permutes(hlo: str) -> list[str]:
    """The collective-permutes XLA put inside the conds that the stages take apart (``STAGE_ACTIONS``)."""
    from autoshard.pipeline.spmd_program import STAGE_ACTIONS

    return [line.strip()[:160] for line in hlo.splitlines() if re.search(r"collective-permute(?:-start)?\(", line)
            and f"/{STAGE_ACTIONS}/" in line]


def test_stages_data_parallel_over_a_few_rows_keep_every_collective_where_all_devices_run_it() -> None:
    # 2 stages of 4 devices, each data parallel over its microbatch's 4 rows (one a device), 2 microbatches:
    # the batch argument comes split by rows over the whole batch (microbatch 0 on devices 0 and 1), so
    # putting a microbatch into the stage's layout moves rows between devices, a collective-permute. Made
    # inside the head's cond (stage 0 only) it hung the step (the other stage never joins); made once a
    # step before the loop, on every device, the step runs and computes jax.jit's numbers. The layouts are
    # given, not planned: no price decides them.
    step, train_step, state, batch = _data_parallel_stages(rows=4, M=2, layers=2)
    hlo = step.lower(state, batch).compile().as_text()
    assert not _stage_branch_permutes(hlo), _stage_branch_permutes(hlo)  # checked before running: no hang
    _matches_jit(step, train_step, state, batch, steps=1)


@pytest.mark.parametrize("form,name", [pytest.param("state", "1f1b", marks=pytest.mark.slow),
                                       pytest.param("optax", "gpipe", marks=pytest.mark.slow),
                                       pytest.param("optax", "interleaved-1f1b", marks=pytest.mark.slow),
                                       pytest.param("optax:scan", "1f1b", marks=pytest.mark.slow),
                                       # CI: the spread tail's numerics in one process (the golden heavy tail)
                                       pytest.param("optax:heavy", "zb-h1", marks=pytest.mark.slow),
                                       # models written as users write them (trace.structure finds their
                                       # blocks): Llama's layers/0.. reading a padding mask and RoPE tables
                                       # beside the stream, GPT-2's h/0, ordinal names
                                       # (CI: the llama and style cases under 1f1b, zb-h1 and interleaved-1f1b
                                       # in one launch, below)
                                       pytest.param("llama", "1f1b", marks=pytest.mark.slow),
                                       pytest.param("llama", "zb-h1", marks=pytest.mark.slow),
                                       pytest.param("llama", "interleaved-1f1b", marks=pytest.mark.slow),
                                       pytest.param("llama", "zb-v", marks=pytest.mark.slow),
                                       pytest.param("style:numbered", "zb-h1", marks=pytest.mark.slow),
                                       pytest.param("style:numbered", "interleaved-1f1b", marks=pytest.mark.slow),
                                       pytest.param("style:unnumbered", "interleaved-1f1b", marks=pytest.mark.slow),
                                       pytest.param("style:numbered", "1f1b", marks=pytest.mark.slow),
                                       pytest.param("style:unnumbered", "1f1b", marks=pytest.mark.slow),
                                       pytest.param("style:unnumbered", "zb-h1", marks=pytest.mark.slow),
                                       # no layer before the blocks: the first block reads the batch
                                       pytest.param("mlp:batch", "1f1b", marks=pytest.mark.slow)])
def test_a_pipeline_across_two_processes_matches_one_process_jit(tmp_path: Path, form: str, name: str) -> None:
    reports = multiproc.run("pipeline_worker.py", tmp_path, name, form, timeout=900)
    _across_processes_as_jit(tmp_path / "0", form, name, [r[0] for r in reports])


def test_llama_and_models_in_two_styles_run_across_two_processes_as_jit(tmp_path: Path) -> None:
    # issue #48's runs, in one launch of two processes (one start and import for nine cases, CI's time):
    # examples/llama.py (layers/0.., a padding mask and RoPE tables read by every block, its final RMSNorm
    # written by hand) and the example GPT written with numbered children (h/0) and with unnumbered blocks,
    # each under 1F1B, ZB-H1 and interleaved 1F1B; each case's 3 steps equal jax.jit's on one process
    cases = [(form, name) for form in ("llama", "style:numbered", "style:unnumbered")
             for name in ("1f1b", "zb-h1", "interleaved-1f1b")]
    with multiproc.running("pipeline_worker.py", tmp_path, *[x for form, name in cases for x in (name, form)]) as procs:
        for form in dict.fromkeys(form for form, _ in cases):  # jax.jit's steps, while the processes run
            _jit_steps(form)
        reports = multiproc.reports(procs, timeout=1500)
    for k, (form, name) in enumerate(cases):
        _across_processes_as_jit(tmp_path / str(k), form, name, [r[k] for r in reports])


@pytest.mark.slow  # multi-process (CI time): one process, both runtimes, in test_pipeline_dropout
def test_a_dropout_model_runs_across_two_processes_with_jits_masks(tmp_path: Path) -> None:
    # dropout on the embedding, in every block and before the head, the key split each step: across two
    # processes (each with its own rows of the batch) every microbatch draws its rows of jax.jit's masks
    # (``pipeline.draws``), and 3 steps equal jax.jit's on one process, under 1F1B and ZB-H1
    cases = [("dropout", name) for name in ("1f1b", "zb-h1")]
    with multiproc.running("pipeline_worker.py", tmp_path, *[x for form, name in cases for x in (name, form)]) as procs:
        _jit_steps("dropout")
        reports = multiproc.reports(procs, timeout=1500)
    for k, (form, name) in enumerate(cases):
        _across_processes_as_jit(tmp_path / str(k), form, name, [r[k] for r in reports])


def _across_processes_as_jit(out: Path, form: str, name: str, reports: list[dict]) -> None:
    """A case of ``pipeline_worker`` (its output ``out``, each process's report of it) ran as one program
    across both processes, planned as ``name``, and its 3 steps equal ``jax.jit``'s on one process."""
    assert [r["runtime"] for r in reports] == ["SpmdPipelineStep"] * 2, (form, name)  # one program, across processes
    assert reports[0]["losses"] == reports[1]["losses"]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["kind"] == "pipeline" and plan["schedule"] == name
    if form.endswith(":heavy"):  # the tail spread over stages: its exchanges run on both processes
        assert plan["tail_split"] > 1
    got = np.load(out / "result.npz")
    losses, leaves = _jit_steps(form)
    assert global_rel_error(losses, got["losses"]) <= TOL
    assert global_rel_error(leaves, [got[f"leaf_{i}"] for i in range(len(leaves))]) <= TOL


@functools.cache
def _jit_steps(form: str) -> tuple[np.ndarray, list[Any]]:
    """``pipeline_forms.make(form)``'s step run 3 times under ``jax.jit`` on one process: its losses and the
    leaves of its state after (made once per form: several schedules compare to it)."""
    fn, args, batch = make(form)
    ref = jax.jit(fn)
    want, losses = list(args), []
    for _ in range(3):
        *want, m = ref(*want, batch)
        losses.append(float(m["loss"]))
    return np.array(losses), jax.tree.leaves(want)


def _zb_v_step(stages: int, layers: int, M: int, devices: int) -> tuple[SpmdPipelineStep, Any, Any, Any]:
    """The tiny GPT (``layers`` blocks, 2 rows a microbatch) as ZB-V's SPMD program on ``stages`` stages of
    ``devices / stages`` devices: the step, the example's train step, its state and batch."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [f"layers={layers}", f"batch={2 * M}"], abstract=False)
    state, batch = ex.args
    full = trace(ex.train_step, state, batch)
    micro = trace_microbatch(ex.train_step, ex.args, full, M)
    step = SpmdPipelineStep(micro, full, stage_mesh(jax.devices()[:devices], stages), M, "zb-v")
    return step, ex.train_step, state, batch


@pytest.mark.slow  # CI: ZB-V with its tail spread, test_a_tail_spread_over_stages_gives_jits_numbers[zb-v-2-2]
def test_zb_v_runs_its_two_chunks_in_a_v_and_gives_jits_numbers() -> None:
    # ZB-V: 2 stages of 2 chunks (a block each), chunk 1 of stage s running virtual stage 3 - s, so the head
    # and the tail both run on stage 0 and the turn stays on stage 1; 3 steps equal jax.jit's
    step, train_step, state, batch = _zb_v_step(stages=2, layers=4, M=4, devices=2)
    assert step.num_chunks == 2 and step.ticks.v_shape and step.ticks.weight_pass
    assert step.schedule.place(0) == (0, 0) and step.schedule.place(3) == (0, 1)
    _matches_jit(step, train_step, state, batch)


@pytest.mark.slow  # CI: the case above
def test_zb_v_on_four_stages_of_two_devices_keeps_its_exchanges_out_of_the_stages_branches() -> None:
    # 4 stages of 2 devices, 8 microbatches: stages exchange with both neighbours in a tick (chunk 0's stream
    # up, chunk 1's down), at the tick's top level; the numbers are jax.jit's
    step, train_step, state, batch = _zb_v_step(stages=4, layers=8, M=8, devices=8)
    hlo = step.lower(state, batch).compile().as_text()
    assert not _stage_branch_permutes(hlo), _stage_branch_permutes(hlo)
    _matches_jit(step, train_step, state, batch)


@pytest.mark.slow
def test_zb_v_exchanging_streams_and_cotangents_apart_gives_the_same_numbers() -> None:
    # where the stream's and the cotangent's shapes differ, each goes its own way (four ppermutes a tick)
    step, train_step, state, batch = _zb_v_step(stages=2, layers=4, M=4, devices=2)
    step.merge_exchanges = False  # before the first call traces the program
    hlo = step.lower(state, batch).as_text()
    assert hlo.count("collective_permute") == 4, hlo.count("collective_permute")
    _matches_jit(step, train_step, state, batch)


@pytest.mark.slow
def test_zb_v_holds_about_1f1bs_activations_whatever_the_microbatch_count() -> None:
    # XLA's temp bytes of the compiled program (4 stages, 8 blocks, 16 rows a microbatch): ZB-V keeps at most
    # 2S chunk-microbatches in flight a stage, each half a stage's blocks, as 1F1B keeps S whole ones, and
    # one W's inputs (B's inner gradients) at a time, as ZB-H1 does; neither grows with M
    temp = {}
    for M in (8, 32):
        ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=8", f"batch={16 * M}"], abstract=True)
        full = trace(ex.train_step, *ex.args)
        micro = trace_microbatch(ex.train_step, ex.args, full, M)
        for name in ("1f1b", "zb-v"):
            step = SpmdPipelineStep(micro, full, stage_mesh(jax.devices()[:4], 4), M, name)
            temp[(name, M)] = step.lower(*ex.args).compile().memory_analysis().temp_size_in_bytes
    for M in (8, 32):
        assert temp[("zb-v", M)] <= 1.05 * temp[("1f1b", M)], temp
    assert temp[("zb-v", 32)] <= 1.01 * temp[("zb-v", 8)], temp


def test_the_price_is_the_lockstep_of_the_schedule() -> None:
    from types import SimpleNamespace



    sched = schedule("1f1b", 2, 4)
    link = SimpleNamespace(latency=1e-6, bandwidth=1e9)
    got = price([3.0, 6.0], [0.5, 0.25], ticks(sched), stream_bytes=4e3, link=link, inner=2, dispatch=1e-4)
    # by hand from the slots: each slot lasts as long as its slowest action (forward = 1/3, backward = 2/3
    # of a stage's micro time), and every slot exchanges twice
    f, b = [1.0, 2.0], [2.0, 4.0]
    work = sum(max((f if a.kind == "forward" else b)[a.stage] for a in slot) for slot in sched.slots)
    exchange = len(sched.slots) * 2 * (1e-6 + 2e3 / 1e9)
    assert got.ticks == len(sched.slots)
    assert got.loop == pytest.approx(work + exchange) and got.exchange == pytest.approx(exchange)
    assert got.step == pytest.approx(work + exchange + 0.5 + 1e-4)
    # the asynchronous 1F1B of the same stages (each stage at its own pace) is never slower
    assert sched.simulate([1.0, 2.0], [2.0, 4.0]).makespan <= work
    # ZB-H1: B and W a forward each, so equal stages lose nothing to the lockstep, where 1F1B's unit ticks
    # make a forward wait for a backward elsewhere (4/3 of the work in the steady state)
    zb, one = schedule("zb-h1", 4, 16), schedule("1f1b", 4, 16)
    got = price([3.0] * 4, [0.0] * 4, ticks(zb), stream_bytes=0.0, link=link, inner=1, dispatch=0.0)
    work = sum(max(1.0 for _ in slot) for slot in zb.slots)
    assert got.loop == pytest.approx(work + len(zb.slots) * 2 * 1e-6)
    assert work == pytest.approx(zb.simulate([1.0] * 4, [1.0] * 4, weight_times=[1.0] * 4).makespan)
    lock_1f1b = price([3.0] * 4, [0.0] * 4, ticks(one), stream_bytes=0.0, link=link, inner=1, dispatch=0.0)
    assert got.loop < 0.8 * lock_1f1b.loop


def test_a_spread_tail_is_priced_as_its_ticks_run_and_from_the_light_tables_alike() -> None:
    from types import SimpleNamespace

    from autoshard.pipeline.ticks import action_tables

    link = SimpleNamespace(latency=1e-6, bandwidth=1e9)
    S, M, G, tail = 4, 8, 2, 0.6
    sched = schedule("zb-h1", S, M, tail_gap=1)
    t = ticks(sched, G)
    got = price([3.0, 3.0, 3.0, 3.0 - tail], [0.0] * S, t, stream_bytes=4e3, link=link, inner=2, dispatch=0.0,
                tail=tail)
    # by hand: each action a forward (1.0, the last stage's 0.8 without its tail); at a tail tick the last G
    # stages each add tail / G; G - 1 slices go out and come back on each tail tick
    f = [1.0, 1.0, 1.0, (3.0 - tail) / 3]
    work = sum(max([f[a.stage] + (tail / G if (t.tail_micro[k] >= 0 and a.stage >= S - G) else 0.0) for a in slot]
                   + ([tail / G] if t.tail_micro[k] >= 0 else []))
               for k, slot in enumerate(sched.slots))
    tail_x = M * 2 * (G - 1) * (1e-6 + 4e3 / G / 2 / 1e9)
    assert got.loop == pytest.approx(work + len(sched.slots) * 2 * (1e-6 + 2e3 / 1e9) + tail_x)
    # the planner prices from the actions alone (no buffer slots): the same numbers, for every form
    forms = [(schedule(n, S, M, c, tail_gap=1), c) for n, c in (("1f1b", 1), ("gpipe", 1), ("zb-h1", 1),
                                                                ("interleaved-1f1b", 2))]
    for sc, c in forms:
        times = list(np.linspace(1.0, 2.0, S * c))
        for g in (1, G):
            want = price(times, [0.0] * S, ticks(sc, g), stream_bytes=4e3, link=link, inner=2, tail=tail)
            assert price(times, [0.0] * S, action_tables(sc, g), stream_bytes=4e3, link=link, inner=2,
                         tail=tail) == want
    for g in (1, G):
        times = [1.0, 2.0, 3.0, 4.0]
        assert price(times, [0.0] * S, lockstep_tables("1f1b", S, M, fused=True, tail_split=g), stream_bytes=4e3,
                     link=link, inner=2, tail=tail) == price(times, [0.0] * S, fused_1f1b(S, M, g), stream_bytes=4e3, link=link, inner=2,
                                         tail=tail)


def test_a_plan_made_for_the_program_runs_as_the_program() -> None:
    """A pipeline planned for the SPMD program (``runtime="spmd"``, or a mesh across hosts planned ahead) and
    given to ``parallelize`` runs as that program, as priced, even from one process (``runtime="auto"``),
    and computes what ``jax.jit`` does."""
    fn, args, batch = make("optax")
    want = jax.tree.map(lambda x: np.asarray(x).copy(), args)
    plan = autoshard.plan(fn, *args, batch, mesh=(2, 4), microbatches=4, pipeline=True, stage_shape=(1, 2),
                          time_budget_s=8, runtime="spmd")
    assert plan.spmd
    step = autoshard.parallelize(fn, mesh=(2, 4), plan=plan)
    *got, m1 = step(*args, batch)
    *want, m2 = jax.jit(fn)(*want, batch)
    assert type(step._last.step).__name__ == "SpmdPipelineStep"
    assert global_rel_error(np.asarray(m2["loss"]), np.asarray(m1["loss"])) <= TOL
    assert global_rel_error(jax.tree.leaves(want), jax.tree.leaves(got)) <= TOL


@pytest.mark.slow
def test_parallelize_on_a_mesh_across_hosts_plans_and_runs_the_spmd_program_from_one_process() -> None:
    """``runtime="auto"`` decides alike in ``plan`` and ``parallelize`` (``target.runtime_options``): a mesh
    across hosts (2 hosts of 4 devices here) gets a pipeline planned for the SPMD program even from one
    process, and runs as that program (``target.runs_spmd``), as ``jax.jit`` computes."""
    from cost_models import CostModel

    fn, args, batch = make("optax")
    want = jax.tree.map(lambda x: np.asarray(x).copy(), args)
    hosts = CostModel.load("h100", mesh_shape=(2, 4), axis_names=("node", "gpu"), num_hosts=2, devices_per_host=4)
    step = autoshard.parallelize(fn, mesh={"node": 2, "gpu": 4}, hardware=hosts, microbatches=4, pipeline=True,
                                 stage_shape=(1, 2), time_budget_s=8)
    *got, m1 = step(*args, batch)
    *want, m2 = jax.jit(fn)(*want, batch)
    assert step.plan.spmd and type(step._last.step).__name__ == "SpmdPipelineStep"
    assert global_rel_error(np.asarray(m2["loss"]), np.asarray(m1["loss"])) <= TOL
    assert global_rel_error(jax.tree.leaves(want), jax.tree.leaves(got)) <= TOL


def test_golden_uniform_blocks_on_two_hosts_give_stages_inside_hosts_and_one_program() -> None:
    # 4 wide blocks (hidden 2048, bf16) on 2 hosts of 4 H100s, 3 GB a device: the weights and Adam state
    # (~2.6 GB a replica) fit no device whole; NVLink inside a host, InfiniBand between hosts
    overrides = dict(hidden=2048, heads=16, seq_len=256, batch=32, vocab=1024, dtype="bfloat16")
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", *(f"{k}={v}" for k, v in overrides.items())],
                      abstract=True)
    plan = autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), hardware="h100", memory_budget=3e9,
                          microbatches=8, pipeline=True, time_budget_s=20, runtime="spmd", recompute="none")
    S = plan.num_physical_stages
    assert plan.spmd  # and it says so in the plan it saves
    # uniform: equal submeshes, none across the slow link, every host used, the same number of blocks a stage
    assert len({st.submesh for st in plan.stages}) == 1 and all(st.submesh[0] == 1 for st in plan.stages)
    assert {st.origin[0] for st in plan.stages} == {0, 1} and 4 % S == 0
    assert plan.schedule == "1f1b" and plan.peak_memory <= 3e9
    # each stage keeps its blocks' weights split over its devices (no device holds a replica)
    micro, full = _micro(micro=8, **overrides)
    kernels = [t for t in micro.inputs if micro.tensors[t].name.endswith("kernel")
               and micro.tensors[t].name.startswith("state.params.block_")]
    stored = {t: spec for st in plan.stages for t, spec in st.update_specs.get((), {}).items()}
    assert len(kernels) == 16 and all(not stored[t].is_replicated() for t in kernels)
    # one program for all of it, its stages exchanging over the stage axis (where the collectives sit is
    # checked on a compiled program by test_the_program_exchanges_on_the_stage_axis_and_reduces_once)
    from autoshard.pipeline.spmd_program import spmd_pipeline_step

    step = spmd_pipeline_step(micro, full, plan, jax.devices())
    assert step.mesh.shape["stage"] == S and step.ticks.fused == plan.fused_ticks
    assert step.ticks.res_slots == min(2 * S - 1 if plan.fused_ticks else S, 8)  # the plan's in-flight rule
    text = step.lower(*ex.args).as_text()
    assert text.count("stablehlo.while") >= 1 and text.count("collective_permute") >= 2


def test_blocks_no_uniform_cut_divides_are_refused_by_name_before_any_layer_is_priced(
        caplog: pytest.LogCaptureFixture) -> None:
    """3 blocks on 8 devices: no stage count that tiles the mesh (2, 4, 8) divides them, so the SPMD
    pipeline is refused, saying what to change, without pricing a layer on any submesh."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=3"], abstract=True)
    with caplog.at_level(logging.INFO, logger="autoshard"), pytest.raises(
            PipelineError, match=r"no uniform cut of the step's 3 repeated blocks .*: 1x1 gives 8, 1x2 gives 4, 1x4 gives 2\)"
                                 r".*stage_shape"):
        autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), microbatches=4, pipeline=True, runtime="spmd",
                       time_budget_s=10)
    assert not any(r.getMessage().startswith("priced") for r in caplog.records)


@pytest.mark.parametrize("name,stages,split", [
    pytest.param("zb-h1", 4, 4, marks=pytest.mark.slow), pytest.param("1f1b", 4, 2, marks=pytest.mark.slow),
    pytest.param("fused", 4, 4, marks=pytest.mark.slow), pytest.param("gpipe", 2, 2, marks=pytest.mark.slow),
    pytest.param("interleaved-1f1b", 2, 2, marks=pytest.mark.slow), ("zb-v", 2, 2),
    pytest.param("zb-v", 4, 4, marks=pytest.mark.slow)])
def test_a_tail_spread_over_stages_gives_jits_numbers(name: str, stages: int, split: int) -> None:
    # the layers after the blocks (final norm, LM head, loss and their backward) run on the last `split`
    # stages (ZB-V, whose last virtual stage is stage 0: the first `split`), a slice of each microbatch's 4
    # rows each (at split 4, one row: JAX traces that tail with other ops, so XLA lays it out), in the tick
    # after the last block's forward; the losses and the parameters of 3 steps are jax.jit's
    from autoshard.pipeline.spmd_program import SpmdPipelineStep

    M, rows = 4, 4
    layers = 2 * stages if name == "zb-v" else 4  # ZB-V: two chunks a stage
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", [f"layers={layers}", f"batch={M * rows}"], abstract=False)
    state, batch = ex.args
    full = trace(ex.train_step, state, batch)
    micro = trace_microbatch(ex.train_step, ex.args, full, M)
    small = trace_microbatch(ex.train_step, ex.args, full, M * split)
    step = SpmdPipelineStep(micro, full, stage_mesh(jax.devices(), stages), M, "1f1b" if name == "fused" else name,
                            num_chunks=2 if name == "interleaved-1f1b" else 1, fused=name == "fused", tail=small)
    assert step.spread is not None and step.spread.split == split and step.ticks.spread
    assert int((step.ticks.tail_micro >= 0).sum()) == M  # each microbatch's tail once
    if name == "zb-v":  # two chunks a stage in a V: the head and the tail on stage 0, the turn on stage S - 1
        assert step.num_chunks == 2 and step.ticks.v_shape and step.ticks.weight_pass
        assert step.schedule.place(0) == (0, 0) and step.schedule.place(2 * stages - 1) == (0, 1)
        assert list(step.ticks.tail_stages()) == list(range(split))
    _matches_jit(step, ex.train_step, state, batch)


def test_a_tail_that_cannot_be_split_by_rows_is_refused_by_name() -> None:
    from autoshard.pipeline.spmd_program import SpmdPipelineStep

    micro, full = _micro(batch=32)  # 8 rows a microbatch
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", "batch=32"], abstract=True)
    small = trace_microbatch(ex.train_step, ex.args, full, 4 * 8)
    with pytest.raises(PipelineError, match=r"tail spread over 8 stages needs between 2 and the 4 stages"):
        SpmdPipelineStep(micro, full, stage_mesh(jax.devices()[:4], 4), 4, "1f1b", tail=small)


def test_golden_a_heavy_tail_is_spread_over_the_last_stages_and_the_step_is_jits() -> None:
    # a vocabulary of 32768 beside a hidden size of 64: the LM head and loss cost several blocks, and the
    # lockstep ticks wait for the stage that runs them; the planner spreads them over the last stages (a
    # slice of each microbatch's 8 rows each), prices the program as it runs, and the numbers are jax.jit's
    from autoshard.pipeline.report import format_pipeline_plan

    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4", "batch=32", "vocab=32768"], abstract=False)
    state, batch = ex.args
    step = autoshard.parallelize(ex.train_step, mesh=(2, 4), microbatches=4, pipeline=True, stage_shape=(1, 2),
                                 time_budget_s=8, runtime="spmd", hardware="a100")
    _matches_jit(step, ex.train_step, state, batch, steps=2)
    plan = step.plan
    assert plan.spmd and plan.tail_split > 1 and 0 < plan.tail_time < plan.stages[-1].micro_time
    prog = step._last.step
    assert prog.spread is not None and prog.spread.split == plan.tail_split
    assert plan.predicted_step_time == pytest.approx(prog.predicted.step - prog.predicted.dispatch, rel=1e-3)
    assert f"run on the last {plan.tail_split} stages" in format_pipeline_plan(plan)
    again = type(plan).from_dict(json.loads(json.dumps(plan.to_dict())))  # a saved plan keeps the spread
    assert (again.tail_split, again.tail_time) == (plan.tail_split, plan.tail_time)


@pytest.mark.parametrize("run", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_golden_zb_v_spreads_a_heavy_tail_from_stage_0_over_the_first_stages(run: bool) -> None:
    # the same heavy tail under ZB-V: its last virtual stage runs on stage 0, beside the head, and every tick
    # in which stage 0 runs its second chunk would wait for the LM head and loss; the planner spreads them
    # over the first stages (stage 0 and its neighbours), prices that, and the program runs it (CI: the plan;
    # its numbers in one process: test_a_tail_spread_over_stages_gives_jits_numbers[zb-v-2-2]; all, -m slow)
    from autoshard.pipeline.report import format_pipeline_plan

    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=8", "batch=32", "vocab=32768"],
                      abstract=not run)
    options = dict(mesh=(2, 4), microbatches=4, pipeline=True, schedule="zb-v", stage_shape=(1, 2),
                   time_budget_s=8, runtime="spmd", hardware="a100")
    if run:
        state, batch = ex.args
        step = autoshard.parallelize(ex.train_step, **options)
        _matches_jit(step, ex.train_step, state, batch, steps=2)
        plan = step.plan
        assert list(step._last.step.ticks.tail_stages()) == list(range(plan.tail_split))
        assert step._last.step.schedule == plan.program  # the program runs the plan's own program
    else:
        plan = autoshard.plan(ex.train_step, *ex.args, **options)
    assert plan.schedule == "zb-v" and plan.num_physical_stages == 4 and plan.tail_split > 1
    assert plan.program == schedule("zb-v", 4, 4, 2, tail_gap=1)
    assert 0 < plan.tail_time < plan.stages[-1].micro_time and plan.place(len(plan.stages) - 1) == (0, 1)
    assert f"run on the first {plan.tail_split} stages" in format_pipeline_plan(plan)


def test_blocks_whose_first_matmul_reads_the_block_input_run_as_the_spmd_program() -> None:
    # residual MLP blocks after an input projection: each block's first weight gradient reads the block's
    # input, which the planner's min rule puts with the layer before (the projection for the first block,
    # the previous block for the others); the uniform cut runs it with its own block, so every stage's
    # blocks are the same computation
    train_step, (state,), batch = make("mlp")
    step = autoshard.parallelize(train_step, mesh=(2, 4), microbatches=4, pipeline=True, runtime="spmd",
                                 stage_shape=(1, 2), time_budget_s=5)
    _matches_jit(step, train_step, jax.tree.map(lambda a: np.array(a).copy(), state), batch)
    assert isinstance(step._last.step, SpmdPipelineStep)


@pytest.mark.parametrize("name,shape", [("1f1b", (1, 2)), ("zb-h1", (1, 2)),
                                        pytest.param("interleaved-1f1b", (1, 4), marks=pytest.mark.slow)])
def test_a_first_block_reading_the_batch_runs_as_the_spmd_program(name: str, shape: tuple[int, int]) -> None:
    # no layer with parameters before the blocks: nothing asks for the gradient of the first block's input,
    # so its backward lacks the transposes the others have; every stage runs the second block's backward
    # (stage 0's input cotangent goes nowhere), with stage 0's weights and residuals
    train_step, (state,), batch = make("mlp:batch")
    micro = trace_microbatch(train_step, (state, batch), trace(train_step, state, batch), 4)
    cut = uniform_stages(micro, 2)
    assert cut.backward.ops == cut.chunk_b[1].ops and len(cut.chunk_b[0].ops) < len(cut.chunk_b[1].ops)
    assert cut.head_act == (micro.inputs[len(jax.tree.leaves(state))],) and not cut.head_f.ops
    step = autoshard.parallelize(train_step, mesh=(2, 4), microbatches=4, pipeline=True, runtime="spmd",
                                 schedule=name, stage_shape=shape, time_budget_s=5)
    _matches_jit(step, train_step, jax.tree.map(lambda a: np.array(a).copy(), state), batch)
    assert isinstance(step._last.step, SpmdPipelineStep) and step.plan.schedule == name


@pytest.mark.slow  # an error's wording, 13 s of tracing: CI keeps to its time
def test_zb_v_runs_on_the_spmd_program_only_and_says_so() -> None:
    # ZB-V's chunks in a V: the MPMD runtime does not run them, so a plan for it is refused by name
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["layers=4"], abstract=True)
    with pytest.raises(PipelineError, match=r"'zb-v' runs two chunks a stage in a V, which only the SPMD program"):
        autoshard.plan(ex.train_step, *ex.args, mesh=(2, 4), microbatches=4, pipeline=True, schedule="zb-v",
                       runtime="mpmd", time_budget_s=5)
