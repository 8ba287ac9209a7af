"""``autoshard.splittable``: a function run on each device's shard of the factors it may be split along (jax's
``custom_partitioning``), planned from its rule and priced by what it calls; the GPT example's flash attention
built from it."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.strategies import custom
from autoshard.target import cost_model_for
from autoshard.trace import costs

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5
RULE = "b q h d, b k h d, b k h d -> b q h d"


def _attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention on [batch, seq, heads, head_dim]: correct only with every key at hand."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones(s.shape[-2:], bool))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1), v)


def _qkv(shape: tuple[int, ...] = (8, 16, 4, 8)) -> tuple[jax.Array, ...]:
    return tuple(jax.random.normal(jax.random.key(i), shape) for i in range(3))


@pytest.mark.parametrize("spec", [P("x", None, "y", None), P(None, "x", "y", None)],
                         ids=["batch-and-heads", "sequence-gathered"])
def test_a_splittable_function_runs_on_each_shard_and_gathers_only_what_it_must(spec: P) -> None:
    """Split over batch and heads, each device calls the function at its shard's shape and the program
    gathers nothing; split along the sequence (a factor it may not be split along), the program gathers
    that dimension first, and the result is still exact."""
    seen: list[tuple[int, ...]] = []

    def attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        seen.append(q.shape)
        return _attention(q, k, v)

    f = autoshard.splittable(attend, RULE, split=("b", "h"))
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    q, k, v = _qkv()
    put = NamedSharding(mesh, spec)
    step = jax.jit(f, in_shardings=(put, put, put))
    got = step(q, k, v)
    assert global_rel_error(_attention(q, k, v), got) <= TOL
    compiled = step.lower(q, k, v).compile().as_text()
    if spec[1] is None:  # batch and heads split: one call per shard, nothing gathered
        assert (4, 16, 1, 8) in seen, seen
        assert "all-gather" not in compiled
    else:  # the sequence may not be split: gathered, then split over heads only
        assert all(s[1] == 16 for s in seen), seen
        assert "all-gather" in compiled or "all-to-all" in compiled


def test_a_splittable_function_is_differentiable_on_each_shard() -> None:
    """Its gradient is a second splittable call (``jax.vjp`` of the function by default, or the backward
    given), run per shard of the same factors: exact, nothing gathered."""
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    q, k, v = _qkv()
    put = NamedSharding(mesh, P("x", None, "y", None))
    f = autoshard.splittable(_attention, RULE, split=("b", "h"))
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2)),
                   in_shardings=(put, put, put))
    want = jax.grad(lambda q, k, v: jnp.sum(_attention(q, k, v) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert global_rel_error(want, grad(q, k, v)) <= TOL
    assert "all-gather" not in grad.lower(q, k, v).compile().as_text()

    calls: list[tuple[int, ...]] = []

    def backward(x: jax.Array, g: jax.Array) -> jax.Array:
        calls.append(x.shape)
        return g * jnp.cos(x)

    sine = autoshard.splittable(jnp.sin, "b d -> b d", split=("b",), backward=backward)
    x = jax.random.normal(jax.random.key(3), (8, 16))
    rows = NamedSharding(mesh, P(("x", "y"), None))
    got = jax.jit(jax.grad(lambda x: jnp.sum(sine(x))), in_shardings=(rows,))(x)
    assert global_rel_error(jnp.cos(x), got) <= TOL
    assert (1, 16) in calls, calls  # the given backward ran on each device's row


def test_splittable_refuses_what_it_cannot_honour() -> None:
    with pytest.raises(ValueError, match="no result"):
        autoshard.splittable(_attention, "b q h d, b k h d, b k h d -> b q h", split=("d",))
    with pytest.raises(ValueError, match="no operand"):  # its backward could not be split along "r"
        autoshard.splittable(lambda x: x[None], "b d -> r b d", split=("r",))
    with pytest.raises(ValueError, match="plain factors"):
        autoshard.splittable(_attention, "... q d, ... k d, ... k d -> ... q d", split=("q",))


def test_the_planner_splits_a_splittable_call_only_along_its_split_factors_and_prices_its_products() -> None:
    """The call's candidates come from its rule (the sequence and head_dim stay whole); a body of matrix
    products is priced at the matmul rate and counts as model flops."""
    f = autoshard.splittable(_attention, RULE, split=("b", "h"))  # differentiable: a second call backward

    def step(w: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        def loss(w: jax.Array) -> jax.Array:
            q = jnp.einsum("bshd,de->bshe", x, w)
            return jnp.mean(f(q, q, q) ** 2)
        return jax.value_and_grad(loss)(w)

    x = jax.random.normal(jax.random.key(0), (64, 256, 8, 64))
    w = jax.random.normal(jax.random.key(1), (64, 64))
    graph = autoshard.trace(step, w, x)
    call, call_backward = [op for op in graph.ops if op.primitive == "custom_partitioning"]
    assert (call.phase, call_backward.phase) == ("forward", "backward")
    assert costs.on_matmul_units(call)
    plan = autoshard.plan(graph, mesh=(8,), hardware="h100", time_budget_s=10)
    for t in (*call.inputs, *call.outputs):
        spec = plan.specs[()][t]
        assert not spec.dims[1] and not spec.dims[3], spec  # sequence and head_dim whole
    assert plan.specs[()][call.outputs[0]].axes_used, "the attention's work should be split"
    cost = cost_model_for("h100", (8,), ("x",))
    vector = cost.compute_time(call.flops, 0.0, "float32", matmul=False)
    products = 2 * 2.0 * 64 * 8 * 256 * 256 * 64  # q·kᵀ and p·v in the forward call, not its replay
    assert plan.model_flops.flops == pytest.approx(3.0 * (products + 2.0 * x.size * 64), rel=1e-9)
    assert cost.compute_time(call.flops, 0.0, "float32", matmul=True) < vector


@pytest.mark.slow
def test_the_gpt_examples_flash_attention_runs_split_like_jit(caplog: pytest.LogCaptureFixture) -> None:
    """GPT with ``flash=True`` (jax's Pallas flash-attention kernels, interpreted on CPU): the kernels are
    split over the batch and the step equals ``jax.jit``'s."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["flash=true"], abstract=False)
    state, batch = ex.args
    par = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=5)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        s_par, m_par = par(state, batch)
    assert "no sharding rule" not in caplog.text and "no cost rule" not in caplog.text, caplog.text
    s_ref, m_ref = jax.jit(ex.train_step)(state, batch)
    assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
    assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL
    calls = [op for op in par.graph.ops if op.primitive == "custom_partitioning"]
    assert len(calls) == 4  # a forward and a backward call per block
    for op in calls:
        for t in (*op.inputs, *op.outputs):
            spec = par.plan.specs[()][t]
            assert not spec.dims[1] and not spec.dims[3], spec
        assert any(par.plan.specs[()][t].axes_used for t in op.outputs)


def test_the_flash_kernels_flops_are_registered_as_products() -> None:
    """The GPT example registers its three kernels; the forward's and the backward's flops are matrix
    products (two and seven a causal (query, key) pair), the preprocessing's are not."""
    load_example(ROOT / "examples" / "gpt.py", "tiny", ["flash=true"], abstract=True)
    assert {"mha_forward", "mha_backward"} <= costs.MATMUL_KERNELS
    assert "mha_preprocess_backward" in custom.KERNELS and "mha_preprocess_backward" not in costs.MATMUL_KERNELS
    shape = (2, 256, 4, 64)
    pairs = 256 * 256 * (1 + 128 / 256) / 2
    assert costs.KERNEL_FLOPS["mha_forward"]([shape] * 3, []) == 2 * 2 * 2 * 4 * 64 * pairs
    assert costs.KERNEL_FLOPS["mha_backward"]([shape] * 5 + [(2, 4, 256)] * 2, []) == 7 * 2 * 2 * 4 * 64 * pairs


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["spmd", "mpmd"])
def test_the_gpt_examples_flash_attention_runs_in_either_pipeline_runtime_like_jit(runtime: str) -> None:
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["flash=true"], abstract=False)
    state, batch = ex.args
    par = autoshard.parallelize(ex.train_step, mesh=(2, 4), time_budget_s=10, pipeline=True, microbatches=2,
                                runtime=runtime)
    s_par, m_par = par(state, batch)
    assert isinstance(par.plan, autoshard.PipelinePlan)
    s_ref, m_ref = jax.jit(ex.train_step)(state, batch)
    assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
    assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL


def test_golden_one_long_sequence_through_a_head_split_kernel_gives_ulysses_sequence_parallelism() -> None:
    """Batch 1, sequence 16384, attention through the flash kernels (split over batch and heads only): the
    projections and the MLP are split along the sequence, the kernels over the heads, and all-to-alls move
    between the two (DeepSpeed-Ulysses), found, not asked for."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny",
                      ["flash=true", "batch=1", "seq_len=16384", "heads=16", "hidden=1024"], abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    plan = autoshard.plan(graph, mesh=(8,), hardware="h100", time_budget_s=10)
    specs = plan.specs[()]
    calls = [op for op in graph.ops if op.primitive == "custom_partitioning"]
    assert calls
    for op in calls:
        for t in op.outputs:
            assert specs[t].dims == ((), (), ("x",), ()), (op.where(), specs[t])  # [b, s, heads, d]: heads
    qkv = [op for op in graph.ops if op.primitive == "dot_general" and op.phase == "forward"
           and op.scope.endswith("attn/qkv")]
    assert qkv and all(specs[op.outputs[0]].dims == ((), ("x",), ()) for op in qkv)  # [b, s, 3h]: sequence
    assert any(k.startswith("all_to_all") for k in plan.collective_counts), plan.collective_counts
