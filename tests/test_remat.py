"""Recompute applied by the planner (``trace.remat``, ``planner.recompute``): the rewritten step keeps its
numerics, holds less memory, costs more compute, and ``recompute="auto"`` turns it on only when the step
does not fit without it."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard._examples import load_module
from autoshard.cli import main as cli_main
from autoshard.emit import global_rel_error
from autoshard.errors import AutoshardError
from autoshard.pipeline.pipeline_plan import graph_digest
from autoshard.planner.plan import DoesNotFit, Plan, PlanError
from autoshard.planner.recompute import fewest_blocks, least_bytes, most_shards, plan_recomputing, recomputed
from autoshard.target import cost_model_for
from autoshard.trace import Graph
from autoshard.trace import jaxpr_compat as jc
from autoshard.trace.buffers import buffers
from autoshard.trace.recompute import estimate, saved_by_selective
from autoshard.trace.remat import _plan, blocks, rematerialize, uniform
from autoshard.trace.tracer import graph_of_jaxpr

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
    # selective replays all but the weight products (Korthikanti et al.): the attention core (QK^T and
    # softmax.V, matmuls with batch dimensions) and the elementwise ops; full replays the weight products too
    names = set(blocks(graph))
    forward = [op for op in graph.ops if op.layer in names and op.phase == "forward"]
    weights = sum(op.flops for op in forward if saved_by_selective(op))
    attention = sum(op.flops for op in forward if op.primitive == "dot_general" and not saved_by_selective(op))
    assert weights > 0 and attention > 0
    # full replays the weight products and, beyond selective, the few fused elementwise values read in the
    # backward that are computed from them (GELU's pieces from the MLP's pre-activation)
    assert weights <= flops["full"] - flops["selective"] <= 1.02 * weights
    assert attention < flops["selective"] - flops["none"] < 0.25 * (flops["full"] - flops["none"])
    assert rematerialize(graph, {}) is graph


def test_full_recompute_frees_every_block_value_before_the_backward_pass() -> None:
    """With every block fully recomputed, no value a block's forward made outlives the forward pass but the
    ones the replays start from (the optimization barriers' operands: each block's input). A fused value
    the backward read from the forward would keep its operands (the MLP's pre-activation) alive instead.
    The last block is left out: the head's backward reads its output (fused from the residual branches)
    before the block's own backward begins, so that output stays, as a checkpoint's output would."""
    _, graph, _ = _gpt()
    g = rematerialize(graph, uniform(graph, "full"))
    buf = buffers(g)
    first_backward = min(op.id for op in g.ops if op.phase == "backward")
    names = set(blocks(graph)[:-1])
    stay = {t for op in g.ops if op.primitive == "optimization_barrier" for t in op.inputs}
    outlive = [(g.ops[t.producer].scope, t.shape) for t in g.tensors
               if t.producer is not None and g.ops[t.producer].phase == "forward"
               and g.ops[t.producer].layer in names and buf.held[t.id] and t.id not in stay
               and buf.live[t.id][1] > first_backward]
    assert not outlive


def test_unknown_mode_or_setting_is_refused() -> None:
    _, graph, _ = _gpt()
    with pytest.raises(AutoshardError, match=r"recompute mode 'some'.*none, invariant, selective, full"):
        rematerialize(graph, {blocks(graph)[0]: "some"})
    with pytest.raises(PlanError, match=r"recompute='sometimes'.*auto"):
        autoshard.plan(graph, mesh=(2,), recompute="sometimes")


def test_auto_recomputes_only_when_the_step_does_not_fit_and_only_the_blocks_it_must() -> None:
    _, graph, _ = _gpt()
    cost = cost_model_for("h100", (1,), ("x",))
    kw: dict[str, Any] = {"hardware": "h100", "time_budget_s": 10}
    roomy, same = plan_recomputing(graph, cost, memory_budget=None, **kw)
    assert same is graph and not roomy.recompute
    full, _ = plan_recomputing(graph, cost, recompute="full", memory_budget=None, **kw)
    sel, _ = plan_recomputing(graph, cost, recompute="selective", memory_budget=None, **kw)
    assert full.peak_memory < sel.peak_memory < roomy.peak_memory
    assert roomy.predicted_step_time < sel.predicted_step_time < full.predicted_step_time
    # a budget between selective's peak and the step's: auto chooses selective, on the first blocks only,
    # faster than selective on every block under the same budget
    budget = (sel.peak_memory + roomy.peak_memory) / 2
    tight, rewritten = plan_recomputing(graph, cost, memory_budget=budget, **kw)
    every, _ = plan_recomputing(graph, cost, recompute="selective", memory_budget=budget, **kw)
    names = blocks(graph)
    assert set(tight.recompute.values()) == {"selective"} and 0 < len(tight.recompute) < 4
    assert list(tight.recompute) == names[:len(tight.recompute)]
    assert tight.predicted_step_time < every.predicted_step_time and tight.peak_memory <= budget
    assert rewritten is not graph and tight.peak_memory < roomy.peak_memory
    # between full's and selective's: full on the first blocks, selective on the rest (full everywhere fits,
    # and is slower)
    budget = (full.peak_memory + sel.peak_memory) / 2
    tighter, _ = plan_recomputing(graph, cost, memory_budget=budget, **kw)
    every, _ = plan_recomputing(graph, cost, recompute="full", memory_budget=budget, **kw)
    modes = [tighter.recompute.get(b, "none") for b in names]
    k = modes.count("full")
    assert 0 < k < 4 and modes == ["full"] * k + ["selective"] * (4 - k), modes
    assert tighter.predicted_step_time < every.predicted_step_time and tighter.peak_memory <= budget
    # below full's: the error says what each setting needs
    with pytest.raises(DoesNotFit, match=r"recompute or not \(as traced at least .* GB, with selective "
                       r"recompute at least .* GB, with full recompute at least .* GB, of its 4 blocks\)") as e:
        plan_recomputing(graph, cost, memory_budget=0.5 * full.peak_memory, **kw)
    assert e.value.needed is not None and e.value.needed > 0.5 * full.peak_memory
    # recompute="none" never rewrites, even when it does not fit
    with pytest.raises(DoesNotFit):
        plan_recomputing(graph, cost, recompute="none", memory_budget=(sel.peak_memory + roomy.peak_memory) / 2,
                         **kw)


@pytest.mark.parametrize(("mode", "prev"), [("full", "selective"), ("selective", "none")])
def test_fewest_blocks_is_the_least_mix_whose_rewritten_step_meets_the_limit(mode: str, prev: str) -> None:
    """Against every ``k``: the rewritten step's least-bytes peak (what the solver's memory check proves)
    for ``mode`` on the first ``k`` blocks and ``prev`` on the rest. ``fewest_blocks`` returns, for each
    limit, a ``k`` that meets it where ``k - 1`` does not, and the step rewritten so; the least such ``k``
    where the peaks fall with ``k`` (full over selective; the last block's selective replay, which runs
    as the backward pass starts, raises the tiny GPT's peak a little: 2.350 to 2.380 MB)."""
    _, graph, _ = _gpt()
    cost = cost_model_for("h100", (2, 4), ("x", "y"))
    names = blocks(graph)
    size = least_bytes(cost.mesh)

    def config(k: int) -> dict[str, str]:
        return {b: (mode if i < k else prev) for i, b in enumerate(names)}

    peaks = [estimate(recomputed(graph, {b: m for b, m in config(k).items() if m != "none"}), "none",
                      nbytes=size).peak_bytes for k in range(len(names) + 1)]
    falling = all(a >= b for a, b in itertools.pairwise(peaks))
    assert peaks[0] > min(peaks) and falling == (mode == "full"), peaks
    for limit in sorted({*peaks, *((a + b) / 2 for a, b in itertools.pairwise(peaks))}):
        k, rewritten = fewest_blocks(graph, names, mode, prev, limit, cost.mesh)
        assert estimate(rewritten, "none", nbytes=size).peak_bytes == peaks[k]
        if peaks[-1] > limit:  # the search starts from every block at ``mode``: nothing meets it there
            assert k == len(names), (limit, k, peaks)
            continue
        assert peaks[k] <= limit and (k == 0 or peaks[k - 1] > limit), (limit, k, peaks)
        if falling:
            assert k == next(i for i, p in enumerate(peaks) if p <= limit), (limit, k, peaks)
    # a limit nothing meets: every block at ``mode``
    k, rewritten = fewest_blocks(graph, names, mode, prev, 0.5 * min(peaks), cost.mesh)
    assert k == len(names) and estimate(rewritten, "none", nbytes=size).peak_bytes == peaks[-1]


def test_most_shards_splits_only_what_the_axes_divide() -> None:
    assert most_shards((25600, 102400), (384, 8)) == 8  # GPT-1T's MLP kernel: 384 = 3 x 128 divides neither
    assert most_shards((3072, 2048, 25600), (384, 8)) == 3072  # its activations split both ways
    assert most_shards((16, 64), (2, 4)) == 8 and most_shards((6,), (4,)) == 1 and most_shards((), (8,)) == 1
    assert most_shards((12,), (2, 3)) == 6  # two axes on one dimension
    assert most_shards((4, 9), (4, 3, 1)) == 12


def test_a_mode_no_split_can_fit_is_refused_before_its_rewrite_and_build(caplog) -> None:
    """On a mesh of 7 nothing in the tiny GPT divides: every value stays whole, so a budget under the step's
    unsharded peak with full recompute cannot be met whatever the layouts, though that peak spread over 7
    devices would fit. Every mode is refused from the bound (no problem built) and the message says why."""
    import logging

    from autoshard.trace.recompute import estimate

    _, graph, _ = _gpt()
    cost = cost_model_for("h100", (7,), ("x",))
    full = estimate(graph, "full").peak_bytes
    budget = full / 2
    assert full / 7 < budget
    with caplog.at_level(logging.INFO, logger="autoshard"), pytest.raises(DoesNotFit) as e:
        plan_recomputing(graph, cost, memory_budget=budget, hardware="h100", time_budget_s=5)
    assert "built the problem" not in caplog.text
    assert caplog.text.count("as far as the mesh's axes divide it") == 3
    assert "as far as the mesh's axes divide its dimensions" in str(e.value)


@pytest.mark.parametrize("mode", ["selective", pytest.param("full", marks=pytest.mark.slow)])
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


def test_a_step_recomputing_only_its_first_blocks_matches_jit() -> None:
    """A budget only some blocks' recompute meets: ``parallelize`` emits the planner's per-block choice (the
    first blocks selective, the others as traced) and computes the unsharded step's numbers."""
    step, graph, args = _gpt(concrete=True)
    cost = cost_model_for("h100", (1,), ("x",))
    kw: dict[str, Any] = {"hardware": "h100", "time_budget_s": 10}
    roomy, _ = plan_recomputing(graph, cost, memory_budget=None, **kw)
    sel, _ = plan_recomputing(graph, cost, recompute="selective", memory_budget=None, **kw)
    par = autoshard.parallelize(step, mesh=(1,), hardware="h100", memory_budget=(sel.peak_memory + roomy.peak_memory) / 2,
                                time_budget_s=30)
    ref = jax.jit(step)
    (want, batch), got = args, args[0]
    for _ in range(STEPS):
        want, m1 = ref(want, batch)
        got, m2 = par(got, batch)
        assert abs(float(m2["loss"]) - float(m1["loss"])) <= TOL * abs(float(m1["loss"]))
    assert global_rel_error(want.opt_state, got.opt_state) <= TOL
    assert set(par.plan.recompute.values()) == {"selective"} and 0 < len(par.plan.recompute) < len(blocks(graph))


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


def test_the_rewrite_keeps_every_ops_phase_and_block() -> None:
    """The pipeline splits a step by phase and cuts it by block: a rewritten step must carry the same
    (primitive, phase, block) for every op (ops inside jnp's pjit-wrapped functions used to lose both
    when re-bound flat), plus, in the backward pass of each block, its replayed forward ops and a barrier
    (a pipeline stage then replays in its backward program, not in its forward one)."""
    from collections import Counter

    _, graph, _ = _gpt()
    for mode in ("selective", "full"):
        config = uniform(graph, mode)
        g = rematerialize(graph, config)
        want = Counter((op.primitive, op.phase, op.layer) for op in graph.ops)
        for replay, produced in _plan(graph, config).values():
            want.update((graph.ops[o].primitive, "backward", graph.ops[o].layer) for o in replay)
            # a barrier for each value the replay reads from outside it, beside the block's anchor
            outside = {t for o in replay for t, a in zip(graph.ops[o].inputs, graph.ops[o].eqn.invars, strict=True)
                       if t not in produced and not isinstance(a, jax.extend.core.Literal)}
            layer = graph.ops[replay[0]].layer
            want[("optimization_barrier", "backward", layer)] += len(outside)
            want[("reduce_max", "backward", layer)] += 1
        assert Counter((op.primitive, op.phase, op.layer) for op in g.ops) == want, mode


# -m slow (88 s): CI runs a pipeline recomputing per stage against jit (test_stage_recompute) and a pipeline's
# invariant replays (test_a_pipeline_recomputes_a_blocks_batch_independent_values_first)
@pytest.mark.parametrize("mode", [pytest.param("selective", marks=pytest.mark.slow),
                                  pytest.param("full", marks=pytest.mark.slow)])
def test_a_pipeline_that_recomputes_matches_jit_and_replays_in_its_backward_programs(mode: str,
                                                                                       tmp_path: Path) -> None:
    """Recompute in a pipeline of 2 stages x 4 devices over 4 microbatches: the numbers of the unsharded
    step over 3 steps; each block's replay runs in the backward program of the stage holding the block;
    the plan's choice survives save and load."""
    from autoshard.pipeline import PipelinePlan, format_pipeline_plan
    from autoshard.pipeline.partition import BACKWARD, segments, split_step, trace_microbatch

    step, _, args = _gpt(concrete=True)
    ref = jax.jit(step)
    par = autoshard.parallelize(step, mesh=(2, 4), pipeline=True, microbatches=4, stage_shape=(1, 4), num_layers=4,
                                recompute=mode, time_budget_s=10)
    s_ref = s_par = args[0]
    for _ in range(STEPS):
        s_ref, m_ref = ref(s_ref, args[1])
        s_par, m_par = par(s_par, args[1])
        assert global_rel_error(m_ref, m_par) <= TOL
        assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL
    plan = par.plan
    assert isinstance(plan, PipelinePlan) and len(plan.stages) == 2
    assert set(plan.recompute.values()) == {mode} and len(plan.recompute) == 4
    assert f"recompute: {mode} on 4 blocks" in format_pipeline_plan(plan)
    # where the replays run: the barrier and replayed ops are backward ops of their block's stage
    full = autoshard.trace(step, *args)
    plain = trace_microbatch(step, args, full, 4)
    micro = rematerialize(plain, dict(plan.recompute))
    plan.verify(micro)
    stage_of = plan.stage_of_op()
    parts = split_step(micro)
    barriers = [op for op in micro.ops if op.primitive == "optimization_barrier"]
    # each value a block's replay reads passes a barrier beside the block's anchor (fp32: the microbatch
    # trace has no barrier of its own)
    assert barriers and not any(op.primitive == "optimization_barrier" for op in plain.ops)
    anchors = {op.outputs[0]: op.layer for op in micro.ops if op.primitive == "reduce_max"
               and op.phase == "backward" and micro.tensors[op.outputs[0]].shape == ()}
    assert sorted(anchors.values()) == sorted(plan.recompute)
    assert all(len(b.inputs) == 2 and anchors.get(b.inputs[1]) == b.layer for b in barriers)
    for seg in segments(micro, parts, stage_of):
        for i in seg.ops:
            if micro.ops[i].primitive == "optimization_barrier":
                assert seg.kind == BACKWARD
    path = tmp_path / "pipe.json"
    plan.save(path)
    assert dict(PipelinePlan.load(path).recompute) == dict(plan.recompute)
    rerun = autoshard.parallelize(step, mesh=(2, 4), plan=str(path))
    s, m = rerun(*args)
    s_ref, m_ref = ref(*args)
    assert global_rel_error(m_ref, m) <= TOL and global_rel_error(s_ref.opt_state, s.opt_state) <= TOL


def test_a_pipeline_recomputes_a_blocks_batch_independent_values_first() -> None:
    """``invariant``, the first step of a pipeline's recompute: each block makes its bf16 weights again in
    its backward pass, so nothing a stage stashes per microbatch in flight is the same for every
    microbatch, and the planned stages hold less than the plain trace's (a 1F1B of the bf16 tiny GPT on
    stages of 2 devices, layouts chosen with no budget)."""
    from autoshard.pipeline import microbatch_args, plan_pipeline
    from autoshard.trace.recompute import stashes
    from autoshard.trace.remat import batch_dependent

    mod = load_module(GPT)
    args = mod.make("tiny", abstract=True, dtype="bfloat16", **SMALL)
    full = autoshard.trace(mod.train_step, *args)
    plain = autoshard.trace(mod.train_step, *microbatch_args(args, full, None, 4))
    micro = rematerialize(plain, uniform(plain, "invariant"))

    def invariant_stash(g: Graph) -> float:
        dep = batch_dependent(g)
        return sum(g.tensors[t].nbytes for tids in stashes(g).values() for t in tids if not dep[t])

    assert invariant_stash(micro) == 0 < invariant_stash(plain)
    cost = cost_model_for("h100", (2, 4), ("x", "y"))
    kw: dict[str, Any] = dict(hardware="h100", num_microbatches=4, time_budget_s=5, stage_shape=(1, 2),
                              schedule_name="1f1b")
    held = [max(st.memory for st in plan_pipeline(g, cost, **kw).stages) for g in (micro, plain)]
    assert held[0] < held[1], held


def test_each_replayed_value_passes_a_barrier_of_its_own_beside_a_scalar_anchor() -> None:
    """bf16 blocks under selective recompute replay the casts of their fp32 weight matrices: each value a
    replay reads passes a barrier of its own, beside its block's anchor (the incoming cotangent reduced to
    a scalar), so no barrier asks one value to take another's layout. One barrier holding the matrices
    beside the cotangent priced GPT-1T's selective block 23% dearer (the matrices replicated), and with
    the cotangent a rank apart it was gathered instead."""
    from autoshard.trace.graph import Role

    mod = load_module(GPT)
    graph = autoshard.trace(mod.train_step, *mod.make("tiny", abstract=True, dtype="bfloat16", **SMALL))
    r = rematerialize(graph, uniform(graph, "selective"))
    kernels = {t for t in r.inputs if r.tensors[t].role == Role.PARAM and len(r.tensors[t].shape) == 2
               and r.tensors[t].name.startswith("state.params.block_")}
    barriers = [op for op in r.ops if op.primitive == "optimization_barrier"]
    anchors = {op.outputs[0]: op for op in r.ops if op.primitive == "reduce_max" and op.phase == "backward"
               and r.tensors[op.outputs[0]].shape == ()}
    assert sorted(op.layer for op in anchors.values()) == sorted(blocks(graph))
    for b in barriers:
        _, anchor = b.inputs
        assert anchors[anchor].layer == b.layer
        cotangent = r.tensors[anchors[anchor].inputs[0]]
        assert r.ops[cotangent.producer].phase == "backward" and cotangent.shape[:-1] == (SMALL["batch"], SMALL["seq_len"])
    # every weight matrix of a block is cast again in its backward pass, read through its own barrier
    assert {b.inputs[0] for b in barriers} >= kernels
    assert r.flops_by_phase() == rematerialize(graph, {b: "selective" for b in blocks(graph)}).flops_by_phase()


def _retraced(graph: Graph, modes: dict[str, str]) -> Graph:
    """The rewrite done the other way (as ``trace.remat`` did it before it rewrote the Graph itself): the
    step traced again through JAX, each op bound in schedule order and each block's replay bound before
    its first backward op (behind the barrier), and the new jaxpr made a Graph by the tracer."""
    plan = _plan(graph, modes)
    ops, consts = graph.ops, graph.constants

    def bind(op: Any, invals: list[Any], phase: str | None = None) -> list[Any]:
        subfuns, params = jc.bind_params(op.eqn)
        with jc.eqn_context(op.eqn, phase or op.phase, op.scope):
            outs = op.eqn.primitive.bind(*subfuns, *invals, **params)
        return list(outs) if op.eqn.primitive.multiple_results else [outs]

    def step(*args: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(graph.inputs, args, strict=True))
        again: dict[int, Any] = {}

        def read(tid: int, atom: Any, backward: bool) -> Any:
            if isinstance(atom, jax.extend.core.Literal):
                return atom.val
            if backward and tid in again:
                return again[tid]
            return env[tid] if tid in env else consts[tid]

        for op in ops:
            if op.id in plan:
                replay, produced = plan[op.id]
                anchor = next((read(t, a, True) for t, a in zip(op.inputs, op.eqn.invars, strict=True)
                               if not isinstance(a, jax.extend.core.Literal) and graph.tensors[t].producer is not None
                               and ops[graph.tensors[t].producer].phase == "backward"), None)
                stay = sorted({t for o in replay for t, a in zip(ops[o].inputs, ops[o].eqn.invars, strict=True)
                               if t not in produced and not isinstance(a, jax.extend.core.Literal)})
                tie = []
                if stay and anchor is not None:
                    tie = [anchor]
                    if anchor.shape and jnp.issubdtype(anchor.dtype, jnp.number):
                        with jc.phase_scope("backward", op.scope):
                            tie = [jc.anchor(anchor)]
                local = {}
                for t in stay:  # a barrier for each value, beside the anchor
                    with jc.phase_scope("backward", op.layer or op.scope):
                        local[t] = jax.lax.optimization_barrier((read(t, None, False), *tie))[0]
                for o in replay:
                    ins = [local[t] if t in local else again[t] if t in again else read(t, a, False)
                           for t, a in zip(ops[o].inputs, ops[o].eqn.invars, strict=True)]
                    again.update(zip(ops[o].outputs, bind(ops[o], ins, "backward"), strict=True))
            invals = [read(t, a, op.phase == "backward") for t, a in zip(op.inputs, op.eqn.invars, strict=True)]
            env.update(zip(op.outputs, bind(op, invals), strict=True))
        return [env[t] if t in env else consts[t] for t in graph.outputs]

    closed = jax.make_jaxpr(step)(*graph.jaxpr.in_avals)
    return graph_of_jaxpr(closed, [graph.tensors[t].name for t in graph.inputs],
                          [graph.tensors[t].role for t in graph.inputs], graph.output_names,
                          graph.output_aliases, graph.in_tree, graph.out_tree)


def _dataflow(g: Graph) -> list[tuple[Any, ...]]:
    """Each op in schedule order with what it reads: another op's result (by position), an input of the
    step, or a constant (by shape: a retrace may hold one constant once or once per reader)."""
    def ref(tid: int) -> tuple[Any, ...]:
        t = g.tensors[tid]
        if t.producer is not None:
            return ("op", t.producer, g.ops[t.producer].outputs.index(tid))
        return ("input", g.inputs.index(tid)) if tid in g.inputs else ("const", t.shape, t.dtype)

    return [(op.primitive, op.phase, op.layer, op.scope, op.flops, op.bytes_in, op.bytes_out, op.params,
             [ref(t) for t in op.inputs], [(g.tensors[t].shape, g.tensors[t].dtype) for t in op.outputs])
            for op in g.ops] + [("outputs", [ref(t) for t in g.outputs])]


@pytest.mark.parametrize("mode", ["selective", "full", "full:1,selective:2", "invariant"])
def test_the_rewrite_is_the_step_traced_again_with_its_replays(mode: str) -> None:
    """Rewriting the Graph gives the step JAX traces when each block's replay is bound in its backward pass:
    the same ops in the same order reading the same values, so the same flops per phase, the same peak
    memory, and the digest a pipeline plan records. ``full:1,selective:2``: a mode per block (full on the
    first, selective on the next two, none on the last), as the planner's search between modes makes;
    ``invariant``: each block's batch-independent stash (its weights cast to bf16) made again, the first
    step of a pipeline's recompute (the replayed casts cost bytes, no flops)."""
    _, graph, _ = _gpt()
    invariant = mode == "invariant"
    if invariant:
        mod = load_module(GPT)
        graph = autoshard.trace(mod.train_step, *mod.make("tiny", abstract=True, dtype="bfloat16", **SMALL))
        config: dict[str, str] = {b: "invariant" for b in blocks(graph)}
    elif ":" in mode:
        runs = [(m, int(n)) for m, n in (part.split(":") for part in mode.split(","))]
        per_block = [m for m, n in runs for _ in range(n)]
        config = {b: m for b, m in zip(blocks(graph), per_block + ["none"] * 4, strict=False)}
    else:
        config = uniform(graph, mode)
    mine, traced = rematerialize(graph, config), _retraced(graph, config)
    mine.verify()
    assert _dataflow(mine) == _dataflow(traced)
    assert mine.flops_by_phase() == traced.flops_by_phase()
    assert mine.total_flops > graph.total_flops or (invariant and len(mine.ops) == len(graph.ops) + 4 * 5)
    assert buffers(mine).peak(mine) == buffers(traced).peak(traced) < buffers(graph).peak(graph)
    assert graph_digest(mine) == graph_digest(traced)
    assert [mine.tensors[t].name for t in mine.inputs] == [graph.tensors[t].name for t in graph.inputs]
    assert mine.output_names == traced.output_names
