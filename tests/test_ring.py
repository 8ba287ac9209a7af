"""``autoshard.ring_attention``: causal attention split along the sequence as a zig-zag ring of blockwise
attentions (context parallelism), exact against dense attention, planned and priced as it runs."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import autoshard
from autoshard import ring
from autoshard._examples import load_example
from autoshard.emit import global_rel_error
from autoshard.strategies.registry import RuleContext, strategies_for
from autoshard.target import cost_model_for

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


def _dense(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = True) -> jax.Array:
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = jnp.tril(jnp.ones(s.shape[-2:], bool)) if causal else jnp.ones(s.shape[-2:], bool)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1), v)


def _qkv(shape: tuple[int, ...] = (2, 32, 4, 8)) -> tuple[jax.Array, ...]:
    return tuple(jax.random.normal(jax.random.key(i), shape) for i in range(3))


def _loss(attend: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))


@pytest.mark.parametrize("mesh_shape,spec", [
    pytest.param((8,), P(None, "x", None, None), marks=pytest.mark.slow),  # 8 devices along the sequence
    ((2, 4), P(None, ("x", "y"), None, None)),   # a ring over two mesh axes
    ((2, 4), P("x", "y", None, None)),           # batch over x, sequence over y
    ((2, 4), P(None, "y", "x", None)),           # heads over x, sequence over y
], ids=["seq8", "seq2x4", "batch-seq", "heads-seq"])
def test_ring_attention_split_along_the_sequence_equals_dense_attention(mesh_shape: tuple[int, ...], spec: P) -> None:
    """Forward and gradients exact; the sequence is never gathered: keys and values go round the ring."""
    attend = autoshard.ring_attention()
    mesh = jax.make_mesh(mesh_shape, ("x", "y")[:len(mesh_shape)])
    put = NamedSharding(mesh, spec)
    q, k, v = _qkv()
    f = jax.jit(attend, in_shardings=(put,) * 3, out_shardings=put)
    assert global_rel_error(_dense(q, k, v), f(q, k, v)) <= TOL
    grad = jax.jit(jax.grad(_loss(attend), argnums=(0, 1, 2)), in_shardings=(put,) * 3)
    want = jax.grad(_loss(_dense), argnums=(0, 1, 2))(q, k, v)
    assert global_rel_error(want, grad(q, k, v)) <= TOL
    for text in (f.lower(q, k, v).compile().as_text(), grad.lower(q, k, v).compile().as_text()):
        assert "collective-permute" in text
        assert "all-gather" not in text and "all-to-all" not in text


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_a_ring_over_three_devices_equals_dense_attention_causal_or_not(causal: bool) -> None:
    """An odd ring; without a mask no zig-zag, and every step a block over the keys that came."""
    attend = autoshard.ring_attention(causal=causal)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("x",))
    put = NamedSharding(mesh, P(None, "x", None, None))
    q, k, v = _qkv((2, 24, 4, 8))
    dense = functools.partial(_dense, causal=causal)
    assert global_rel_error(dense(q, k, v), jax.jit(attend, in_shardings=(put,) * 3)(q, k, v)) <= TOL
    grad = jax.jit(jax.grad(_loss(attend), argnums=(0, 1, 2)), in_shardings=(put,) * 3)
    assert global_rel_error(jax.grad(_loss(dense), argnums=(0, 1, 2))(q, k, v), grad(q, k, v)) <= TOL
    assert "collective-permute" in grad.lower(q, k, v).compile().as_text()


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_the_zigzag_layout_gives_device_j_chunks_j_and_2n_minus_1_minus_j_and_comes_back(n: int) -> None:
    """Chunk ``m`` of ``2n`` lands on ``_owner(m)``, low chunk first; the inverse restores the contiguous
    shards (an odd ring too)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("s",))
    x = jnp.arange(2 * n * 3, dtype=jnp.float32).reshape(1, 2 * n * 3)  # chunks of 3

    def local(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        low, high = ring._to_zigzag(x, 1, "s", n)
        return jnp.concatenate([low, high], 1), ring._from_zigzag(low, high, 1, "s", n)

    zz, back = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(None, "s"), out_specs=(P(None, "s"),) * 2))(x)
    np.testing.assert_array_equal(back, x)
    chunks = np.asarray(zz).reshape(n, 2, 3)[:, :, 0] // 3  # the chunk index each device holds
    for j in range(n):
        assert list(chunks[j]) == [j, 2 * n - 1 - j]
        assert ring._owner(j, n) == j and ring._owner(2 * n - 1 - j, n) == j


def test_ring_attention_refuses_what_is_not_self_attention_or_a_sequence_it_cannot_zigzag() -> None:
    attend = autoshard.ring_attention()
    q, k, _ = _qkv()
    with pytest.raises(ValueError, match=r"one shape"):
        attend(q, k[:, :16], k[:, :16])
    mesh = jax.make_mesh((8,), ("x",))
    put = NamedSharding(mesh, P(None, "x", None, None))
    q, k, v = _qkv((2, 8, 4, 8))  # 8 tokens over 8 devices: no 16 chunks
    with pytest.raises((ValueError, jax.errors.JaxRuntimeError), match=r"divisible by 16"):  # XLA wraps it
        jax.jit(attend, in_shardings=(put,) * 3, out_shardings=put)(q, k, v)


def test_the_ring_is_priced_as_it_runs() -> None:
    """Split along the sequence over n devices: each computes its share of the traced flops (the reference
    block computes masked scores: (n + 1) / 2n^2 of the S x S it traces; a kernel skipping them, 1/n), sends
    every sequence-split operand and result once for the zig-zag order, and sends n - 1 shards of K and V
    beside its blocks, paying only what outlasts them; the sequence must split into 2n chunks."""
    assert ring.Ring("s", (1, 2), skips_masked=True).work_share(8) == pytest.approx(1 / 8)
    assert ring.Ring("s", (1, 2), skips_masked=False).work_share(8) == pytest.approx(9 / 128)
    attend = autoshard.ring_attention()
    x = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)
    graph = autoshard.trace(lambda q, k, v: attend(q, k, v), x, x, x)
    (op,) = [o for o in graph.ops if o.primitive == "custom_partitioning"]
    cost = cost_model_for("h100", (8,), ("x",))
    ctx = RuleContext.of(graph, cost.mesh)
    got = {str(s.out_specs[0]): s for s in strategies_for(op, ctx, cost)}
    whole, split = got["R·R·R·R"], got["R·S(x)·R·R"]
    assert "R·R·S(x)·R" in got  # the heads, as splittable does
    assert split.compute_time < whole.compute_time / 8
    shard, lse = x.size * 2 / 8, 8 * 4096 * 4 / 8
    sends = [c for c in split.comm if c.kind == "send_recv"]
    # q, k, v in and out, lse back: two halves each way; then k and v, 7 hops each
    assert sorted(c.nbytes for c in sends) == [lse / 2] * 2 + [shard / 2] * 8 + [shard] * 14
    beside = [c for c in sends if c.nbytes == shard]
    ring_time = 14 * cost.collective_time("send_recv", shard, ("x",))
    assert sum(c.time for c in beside) == pytest.approx(max(0.0, ring_time - split.compute_time))
    back = autoshard.trace(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))), x, x, x)
    (op,) = [o for o in back.ops if o.primitive == "custom_partitioning" and o.phase == "backward"]
    (split,) = [s for s in strategies_for(op, RuleContext.of(back, cost.mesh), cost)
                if str(s.out_specs[0]) == "R·S(x)·R·R"]
    # q, k, v, out, dout and lse in, dq, dk, dv out: two halves each; dk and dv home (a hop each, exposed);
    # k, v, dk, dv go round, 7 hops each
    assert sorted(c.nbytes for c in split.comm) == [lse / 2] * 2 + [shard / 2] * 16 + [shard] * (2 + 28)
    odd = autoshard.trace(lambda q, k, v: attend(q, k, v), *[jax.ShapeDtypeStruct((1, 8 * 5, 8, 64),
                                                                                   jnp.bfloat16)] * 3)
    (op,) = [o for o in odd.ops if o.primitive == "custom_partitioning"]
    specs = {str(s.out_specs[0]) for s in strategies_for(op, RuleContext.of(odd, cost.mesh), cost)}
    assert "R·S(x)·R·R" not in specs  # 40 tokens do not split into 16 chunks


def test_golden_one_long_sequence_with_fewer_heads_than_devices_gives_ring_context_parallelism(
        caplog: pytest.LogCaptureFixture) -> None:
    """Batch 1, a long sequence, two heads on eight devices: the attention calls are split along the
    sequence (a ring), which nothing else can split eight ways."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny",
                      ["ring=true", "batch=1", "seq_len=8192", "heads=2", "hidden=256"], abstract=True)
    graph = autoshard.trace(ex.train_step, *ex.args)
    with caplog.at_level(logging.WARNING, logger="autoshard"):
        plan = autoshard.plan(graph, mesh=(8,), hardware="h100", time_budget_s=10)
    assert "no sharding rule" not in caplog.text
    calls = [op for op in graph.ops if op.primitive == "custom_partitioning"]
    assert len(calls) == 4
    for op in calls:
        assert plan.specs[()][op.outputs[0]].dims == ((), ("x",), (), ()), op.where()
    assert any(k.startswith("send_recv") for k in plan.collective_counts), plan.collective_counts


def _gpt_like_jit(overrides: list[str], mesh: tuple[int, ...], **options: Any) -> Any:
    """The tiny GPT with ``ring=true`` and ``overrides``, parallelized on ``mesh`` with ``options``: its step
    equals ``jax.jit``'s (a finite loss, and the optimizer state); the decorated step, for what its plan did."""
    ex = load_example(ROOT / "examples" / "gpt.py", "tiny", ["ring=true", *overrides], abstract=False)
    state, batch = ex.args
    par = autoshard.parallelize(ex.train_step, mesh=mesh, **options)
    s_par, m_par = par(state, batch)
    s_ref, m_ref = jax.jit(ex.train_step)(state, batch)
    assert math.isfinite(float(m_par["loss"]))
    assert global_rel_error(m_ref["loss"], m_par["loss"]) <= TOL
    assert global_rel_error(s_ref.opt_state, s_par.opt_state) <= TOL
    return par


@pytest.mark.parametrize("blocks", [[], pytest.param(["flash=true"], marks=pytest.mark.slow)],
                         ids=["reference", "flash"])
def test_the_gpt_examples_ring_attention_runs_split_along_the_sequence_like_jit(blocks: list[str]) -> None:
    """GPT with ``ring=true``, batch 1 on eight devices, the ring's blocks the jnp reference or jax's Pallas
    flash kernels (interpreted on CPU): the plan splits the attention along the sequence and the emitted
    step equals ``jax.jit``'s."""
    par = _gpt_like_jit([*blocks, "batch=1", "seq_len=64"], (8,), time_budget_s=5)
    calls = [op for op in par.graph.ops if op.primitive == "custom_partitioning"]
    assert calls and all(par.plan.specs[()][op.outputs[0]].dims[1] for op in calls)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["spmd", "mpmd"])
def test_a_ring_inside_pipeline_stages_runs_like_jit(runtime: str) -> None:
    """One head, so only the ring splits the attention: each stage's calls go round the ring of its own
    submesh (in the SPMD program, inside the stage axis' shard_map), and the step equals ``jax.jit``'s."""
    par = _gpt_like_jit(["batch=2", "seq_len=64", "heads=1"], (2, 4), time_budget_s=10, pipeline=True,
                        microbatches=2, runtime=runtime)
    assert isinstance(par.plan, autoshard.PipelinePlan)
    layouts = {str(s) for st in par.plan.stages for s in st.specs[()].values() if len(s.dims) == 4}
    assert layouts and all(s.startswith("R·S(") for s in layouts), layouts  # [b, s, h, d] split along s


@pytest.mark.slow  # ~45 s
def test_a_recomputed_ring_replays_in_the_backward_pass_like_jit() -> None:
    """Full recompute rewrites each block: its ring forward runs again in the backward pass (a second ring
    call beside the gradient's), and the step still equals ``jax.jit``'s."""
    par = _gpt_like_jit(["batch=1", "seq_len=64", "heads=1"], (8,), time_budget_s=5, recompute="full")
    calls = [op for op in par.graph.ops if op.primitive == "custom_partitioning"]
    assert [op.phase for op in calls].count("backward") == 4  # two replays, two gradients
    assert all(par.plan.specs[()][op.outputs[0]].dims[1] for op in calls)
