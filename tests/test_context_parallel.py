"""Long sequences: attention split along the query sequence (context parallelism, K/V gathered), the causal
mask built split where it is read, and dead values of the differentiated step priced at nothing.

Plans use the H100 prices; programs run on the 8 CPU devices."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import autoshard
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.strategies import RuleContext, strategies_for
from autoshard.target import cost_model_for
from autoshard.trace.buffers import buffers, dead_ops

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
LONG = ["batch=1", "seq_len=2048"]  # one sequence: no batch to split; heads (4) do not divide 8


def _square(graph: autoshard.Graph, seq: int, rank: int) -> list[tuple[autoshard.trace.graph.Op, int]]:
    """(op, result id) of every top-level op whose result ends in [seq, seq] and has ``rank`` dims."""
    out = []
    for op in graph.ops:
        for t in op.outputs:
            shape = graph.tensors[t].shape
            if len(shape) == rank and shape[-2:] == (seq, seq):
                out.append((op, t))
    return out


def _long_plan(abstract: bool = True):
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", LONG, abstract=abstract)
    graph = autoshard.trace(ex.train_step, *ex.args)
    plan = autoshard.plan(graph, mesh=(8,), hardware="h100", time_budget_s=10)
    return ex, graph, plan


def test_batch_one_long_sequence_splits_attention_along_the_query_sequence() -> None:
    """With one long sequence, the scores [1, heads, S, S] are split along the query sequence (dimension 2),
    and the causal mask [S, S] is built split along its rows where the scores read it, never replicated."""
    _, graph, plan = _long_plan()
    seq = 2048
    specs = plan.specs[()]
    scores = [t for op, t in _square(graph, seq, 4) if op.primitive == "dot_general" and op.phase == "forward"]
    assert len(scores) == 2  # one per block
    for t in scores:
        assert specs[t].dims[2] == ("x",), specs[t]
    masks = [(op, t) for op, t in _square(graph, seq, 2) if op.primitive in ("iota", "ge", "select_n")]
    assert masks
    for op, t in masks:
        assert specs[t].dims[0] == ("x",), (op.where(), specs[t])


@pytest.mark.slow
def test_context_parallel_step_matches_jax_jit() -> None:
    """The emitted context-parallel step computes what ``jax.jit`` computes (loss and Adam moments, one
    global relative norm, float32)."""
    ex, graph, plan = _long_plan(abstract=False)
    scores = [t for op, t in _square(graph, 2048, 4) if op.primitive == "dot_general" and op.phase == "forward"]
    assert scores and all(plan.specs[()][t].dims[2] for t in scores)  # the step checked is context parallel
    ref = jax.jit(ex.train_step)
    par = autoshard.parallelize(ex.train_step, mesh=(8,), plan=plan)
    s_ref, batch = ex.args
    s_par = s_ref
    for _ in range(2):
        s_ref, m_ref = ref(s_ref, batch)
        s_par, m_par = par(s_par, batch)
        assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
        assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL


def _where_step(x: jax.Array) -> jax.Array:
    """The differentiated ``jnp.where`` with a constant keeps a zeros tangent of x's shape that nothing reads."""
    mask = jnp.tril(jnp.ones(x.shape[-2:], dtype=bool))
    return jax.grad(lambda y: jnp.sum(jnp.where(mask, y, -1e9) ** 2))(x)


def test_dead_values_hold_no_buffer_and_cost_nothing() -> None:
    x = jax.ShapeDtypeStruct((4, 256, 256), jnp.float32)
    graph = autoshard.trace(_where_step, x)
    dead = dead_ops(graph)
    big = [op for op in graph.ops if op.id in dead and graph.tensors[op.outputs[0]].shape == (4, 256, 256)]
    assert big, "the zeros tangent of jnp.where is expected in the trace"
    buf = buffers(graph)
    cost = cost_model_for("h100", (8,), ("x",))
    ctx = RuleContext.of(graph, cost.mesh)
    for op in big:
        assert not any(buf.held[t] for t in op.outputs)
        assert all(s.time == 0.0 for s in strategies_for(op, ctx, cost))
    live = [op for op in graph.ops if op.id not in dead]
    assert all(not set(op.inputs) & {t for d in big for t in d.outputs} for op in live)
