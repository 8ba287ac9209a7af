"""Gradient accumulation in the pipeline runtime: data-parallel stages return their gradients as unreduced
partial sums, the runtime adds them over microbatches and reduces each once per step (checked in the
compiled HLO), and the pipelined step matches the unsharded one."""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training.train_state import TrainState

import autoshard
from autoshard.emit.program import global_rel_error
from autoshard.errors import AutoshardError
from autoshard.pipeline import (
    PipelineError,
    PipelinePlan,
    build_pipelined_step,
    microbatch_args,
    plan_pipeline,
)
from autoshard.pipeline.partition import UPDATE, WEIGHT
from autoshard.pipeline.runtime import PipelinedStep
from autoshard.pipeline.schedules import one_f_one_b
from autoshard.planner.plan import PlanError
from autoshard.target import cost_model_for
from cost_models import ShardingSpec

TOL = 1e-5
ROWS = 32  # rows per microbatch; the hidden size is 24 so that no parameter has a dimension of 32


class _MLP(nn.Module):
    layers: int = 4

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = x
        for i in range(self.layers):
            h = jnp.tanh(nn.Dense(24, name=f"dense_{i}")(h))
        return jnp.mean(h**2)


class _EmbeddedMLP(nn.Module):
    """``_MLP`` over the embeddings of 8 tokens a row (a vocabulary of 40): the embedding's gradient is a
    scatter-add of the microbatch's rows into zeros."""

    layers: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        return _MLP(self.layers, name="mlp")(nn.Embed(40, 24, name="embed")(tokens))


def _train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    loss, grads = jax.value_and_grad(lambda p: state.apply_fn({"params": p}, batch["x"]))(state.params)
    with jax.numpy_dtype_promotion("standard"):
        return state.apply_gradients(grads=grads), {"loss": loss}


def _state_and_batch(num_microbatches: int, layers: int = 4, *, embed: bool = False
                     ) -> tuple[TrainState, dict[str, jax.Array]]:
    model = _EmbeddedMLP(layers) if embed else _MLP(layers)
    if embed:
        x = jax.random.randint(jax.random.key(0), (num_microbatches * ROWS, 8), 0, 40)
    else:
        x = jax.random.normal(jax.random.key(0), (num_microbatches * ROWS, 16))
    params = model.init(jax.random.key(1), x)["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    return state.replace(step=jnp.zeros((), jnp.int32)), {"x": x}


def data_parallel_pipeline(num_microbatches: int, schedule: str = "1f1b", *, layers: int = 4,
                           num_layers: int = 2, embed: bool = False,
                           **kw) -> tuple[PipelinedStep, TrainState, dict[str, jax.Array]]:
    """Two stages of four devices, each stage data parallel inside its submesh: every value with a batch
    dimension split over the stage's axes, parameters and optimizer state replicated (``embed``: the
    model reads tokens through an embedding)."""
    state, batch = _state_and_batch(num_microbatches, layers, embed=embed)
    full = autoshard.trace(_train_step, state, batch)
    g = autoshard.trace(_train_step, *microbatch_args((state, batch), full, None, num_microbatches))
    cost = cost_model_for("h100", (2, 4), ("x", "y"))
    plan = plan_pipeline(g, cost, hardware="h100", num_microbatches=num_microbatches, num_layers=num_layers,
                         time_budget_s=5, stage_shape=(1, 4), schedule_name=schedule, **kw)

    def dp(axes: tuple[str, ...]) -> dict:
        return {(): {t.id: ShardingSpec(dims=(axes,) + ((),) * (len(t.shape) - 1)) for t in g.tensors
                     if t.shape and t.shape[0] == ROWS and t.role.value in ("batch", "activation")}}

    stages = tuple(dataclasses.replace(st, specs=dp(tuple(st.mesh.axis_names))) for st in plan.stages)
    plan = dataclasses.replace(plan, stages=stages)
    return build_pipelined_step(g, plan, jax.devices()), state, batch


_COLLECTIVE = re.compile(r"\b(?:all-reduce|reduce-scatter)(?:-start)?\(([^)]*)\)")


def reduced_values(hlo: str) -> int:
    """How many values the compiled program all-reduces or reduce-scatters (XLA combines several into one
    instruction: each operand counts)."""
    return sum(m.group(1).count("%") for m in _COLLECTIVE.finditer(hlo))


def _per_step(step: PipelinedStep) -> tuple[int, dict[tuple[int, str], int]]:
    counts = {}
    for (stage, kind, level) in step.programs:
        counts[(stage, f"{kind}{level or ''}")] = reduced_values(step.compiled_text(stage, kind, level))
    for stage in step.reductions:
        counts[(stage, "reduce")] = reduced_values(step.compiled_text(stage, "reduce"))
    B = step.num_microbatches
    total = sum(n * (B if kind in ("forward", "backward") else 1) for (_, kind), n in counts.items())
    return total, counts


def _matches_the_unsharded_step(step, state, batch) -> None:
    """Three steps of the pipelined ``step`` against ``jax.jit`` of the unsharded one: losses and Adam moments."""
    ref = jax.jit(_train_step)
    s_ref = s_pip = state
    for _ in range(3):
        s_ref, m_ref = ref(s_ref, batch)
        s_pip, m_pip = step(s_pip, batch)
        assert global_rel_error(m_ref, m_pip) <= TOL
        assert global_rel_error(s_ref.opt_state, s_pip.opt_state) <= TOL


def test_gradients_are_reduced_once_per_step_whatever_the_microbatch_count() -> None:
    totals = {}
    for B in (4, 8):
        step, state, _ = data_parallel_pipeline(B)
        total, counts = _per_step(step)
        # no per-microbatch program reduces anything: the stages are data parallel, every reduction is of a
        # gradient (or the loss), and those leave the programs unreduced
        assert all(n == 0 for (_, kind), n in counts.items() if kind in ("forward", "backward")), counts
        # each gradient, and the loss, is reduced exactly once, in its stage's reduce program
        n_grads = len(jax.tree.leaves(state.params))
        assert sum(n for (_, kind), n in counts.items() if kind == "reduce") == n_grads + 1, counts
        totals[B] = total
    assert totals[4] == totals[8] > 0


def test_an_embeddings_gradient_is_reduced_once_per_step() -> None:
    # the embedding's gradient, a scatter-add of each device's rows into zeros, is a partial sum like the
    # kernels' and leaves the backward program unreduced: no per-microbatch program reduces anything
    step, state, batch = data_parallel_pipeline(4, embed=True)
    _, counts = _per_step(step)
    assert all(n == 0 for (_, kind), n in counts.items() if kind in ("forward", "backward")), counts
    n_grads = len(jax.tree.leaves(state.params))
    assert sum(n for (_, kind), n in counts.items() if kind == "reduce") == n_grads + 1, counts
    _matches_the_unsharded_step(step, state, batch)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("micro", [4, 8])
def test_accumulated_pipeline_matches_the_unsharded_step(schedule: str, micro: int) -> None:
    step, state, batch = data_parallel_pipeline(micro, schedule)
    assert step.reductions, "the data-parallel stages should carry their gradients unreduced"
    _matches_the_unsharded_step(step, state, batch)


# ---- interleaved 1F1B ----------------------------------------------------------------------------------


@pytest.mark.parametrize("micro", [4, 8])
def test_interleaved_pipeline_matches_the_unsharded_step(micro: int) -> None:
    step, state, batch = data_parallel_pipeline(micro, "interleaved-1f1b", num_layers=4, num_chunks=2)
    # two stages of two chunks: four virtual stages, chunk c of stage s on stage s's submesh
    assert step.schedule.num_chunks == 2 and len(step.stage_meshes) == 4
    assert step.stage_meshes[0] == step.stage_meshes[2] != step.stage_meshes[1] == step.stage_meshes[3]
    total, counts = _per_step(step)
    assert all(n == 0 for (_, kind), n in counts.items() if kind in ("forward", "backward")), counts
    assert total == len(jax.tree.leaves(state.params)) + 1
    _matches_the_unsharded_step(step, state, batch)


def test_interleaved_plan_round_trips_and_checks_its_chunks() -> None:
    state, batch = _state_and_batch(4)
    full = autoshard.trace(_train_step, state, batch)
    g = autoshard.trace(_train_step, *microbatch_args((state, batch), full, None, 4))
    cost = cost_model_for("h100", (2, 4), ("x", "y"))
    plan = plan_pipeline(g, cost, hardware="h100", num_microbatches=4, num_layers=4, time_budget_s=5,
                         stage_shape=(1, 4), schedule_name="interleaved-1f1b", num_chunks=2)
    assert plan.num_chunks == 2 and plan.num_physical_stages == 2 and len(plan.stages) == 4
    assert [st.layers for st in plan.stages] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [st.origin for st in plan.stages] == [(0, 0), (1, 0), (0, 0), (1, 0)]
    assert 0 < plan.bubble_fraction < 1
    back = PipelinePlan.from_dict(plan.to_dict())
    assert back.to_dict() == plan.to_dict()
    wrong = dataclasses.replace(plan.stages[2], origin=plan.stages[1].origin)
    moved = dataclasses.replace(plan, stages=(*plan.stages[:2], wrong, plan.stages[3]))
    with pytest.raises(PlanError, match="virtual stage 2 runs on submesh"):
        moved.verify()
    with pytest.raises(PipelineError, match="pass stage_shape"):
        plan_pipeline(g, cost, num_microbatches=4, num_layers=4, schedule_name="interleaved-1f1b")
    with pytest.raises(PipelineError, match="at least 6 layers"):
        plan_pipeline(g, cost, num_microbatches=4, num_layers=4, stage_shape=(1, 4),
                      schedule_name="interleaved-1f1b", num_chunks=3)


# ---- ZB-H1: the backward split into input- and weight-gradient programs -------------------------------


@pytest.mark.parametrize("micro", [4, 8])
def test_zb_h1_pipeline_matches_the_unsharded_step(micro: int) -> None:
    step, state, batch = data_parallel_pipeline(micro, "zb-h1")
    assert step.schedule.weight_pass
    graph = step.graph
    weight = [p.segment for (_, kind, _), p in step.programs.items() if kind == WEIGHT]
    assert weight
    # the weight programs compute every kernel gradient, and nothing another per-microbatch program reads
    dots = [i for seg in weight for i in seg.ops if graph.ops[i].primitive == "dot_general"
            and any(graph.tensors[t].shape == (24, 24) for t in graph.ops[i].outputs)]
    assert len(dots) == 3  # dense_1..3 (dense_0's kernel is 16 x 24)
    micro_inputs = {t for p in step.programs.values() if p.segment.kind != UPDATE for t in p.segment.inputs}
    assert not any(t in micro_inputs for seg in weight for t in seg.outputs)
    total, counts = _per_step(step)
    assert all(n == 0 for (_, kind), n in counts.items() if kind in ("forward", "backward", "weight")), counts
    assert total == len(jax.tree.leaves(state.params)) + 1
    _matches_the_unsharded_step(step, state, batch)


def test_split_backward_programs_need_a_schedule_with_a_weight_pass() -> None:
    step, _, _ = data_parallel_pipeline(4, "zb-h1")
    segs = [p.segment for p in step.programs.values()]
    meshes = step.stage_meshes
    with pytest.raises(PipelineError, match="has no weight pass"):
        PipelinedStep(step.graph, step.parts, [0] * len(step.graph.ops), segs, meshes, [{}, {}],
                      one_f_one_b(2, 4))


class _Residual(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(24)(x)
        for i in range(4):
            x = x + nn.Dense(24, name=f"layers_{i}")(nn.relu(x))
        return nn.Dense(10)(x)


def _step_with_metrics(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
    """As flax's examples write it: the logits returned as aux, the accuracy computed from them and the labels
    outside the gradient."""
    def loss_fn(p):
        logits = state.apply_fn({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    accuracy = jnp.mean((jnp.argmax(logits, -1) == batch["y"]).astype(jnp.float32))
    with jax.numpy_dtype_promotion("standard"):
        return state.apply_gradients(grads=grads), {"loss": loss, "accuracy": accuracy}


@pytest.mark.parametrize("runtime", ["mpmd", "spmd"])
def test_metrics_computed_from_the_logits_and_labels_outside_the_gradient_run_per_microbatch(runtime: str) -> None:
    """The accuracy reads the batch and the per-example logits outside ``value_and_grad``: it runs with each
    microbatch and its means are averaged (refused before: "reads the batch input 'batch.y' outside the
    gradient computation"), giving jax.jit's loss, accuracy and parameters."""
    model = _Residual()
    x = jax.random.normal(jax.random.key(0), (64, 16), jnp.float32)
    y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
    state = TrainState.create(apply_fn=model.apply, params=model.init(jax.random.key(2), x)["params"],
                              tx=optax.adam(1e-2))
    batch = {"x": x, "y": y}
    par = autoshard.parallelize(_step_with_metrics, mesh=(1, 4), microbatches=4, pipeline=True, stage_shape=(1, 1),
                                runtime=runtime, hardware="h100", time_budget_s=5)
    s_ref = s_par = state
    for _ in range(2):
        s_ref, m_ref = jax.jit(_step_with_metrics)(s_ref, batch)
        s_par, m_par = par(s_par, batch)
        assert global_rel_error(m_ref, m_par) <= TOL
        assert global_rel_error(s_ref.params, s_par.params) <= TOL
    assert isinstance(par.plan, PipelinePlan) and len(par.plan.stages) == 4


def test_an_op_reading_the_batch_and_the_averaged_gradients_is_refused_by_name() -> None:
    """What cannot run per microbatch (it reads the step's gradients, averaged over microbatches, and the batch)
    is still refused, naming the op and the batch input."""
    def step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, jax.Array]:
        grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch["x"]) ** 2))(state.params)
        norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))
        weighted = jnp.mean(batch["x"] * norm)
        with jax.numpy_dtype_promotion("standard"):
            return state.apply_gradients(grads=grads), weighted

    model = _Residual()
    x = jax.ShapeDtypeStruct((64, 16), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    state = jax.eval_shape(lambda p: TrainState.create(apply_fn=model.apply, params=p, tx=optax.sgd(0.1)), params)
    with pytest.raises(AutoshardError, match=r"reads the batch input 'batch\.x' outside the gradient computation"):
        autoshard.plan(step, state, {"x": x}, mesh=(1, 4), microbatches=4, pipeline=True, time_budget_s=5)
