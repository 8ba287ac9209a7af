# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A tour of autoshard
#
# autoshard takes an ordinary JAX train step, traces it into a graph, chooses how to split every tensor
# over a device mesh (one ILP over the whole step), optionally cuts the step into pipeline stages, and runs
# the sharded program. This notebook:
#
# 1. parallelizes the GPT example over 8 devices arranged as a 2x4 mesh,
# 2. reads the plan it chose,
# 3. runs a few steps and checks the loss against plain `jax.jit`,
# 4. plans a larger GPT for a 64-device cluster that is not here (planning needs no devices),
# 5. runs the same step as a pipeline: two stages of four devices, four microbatches.
#
# It runs on a laptop: JAX is asked for 8 simulated CPU devices before it is imported. The plans are
# priced for H100s (`hardware="h100"`), so predicted times are what the cost model expects on that
# hardware, not what the CPU takes.

# %%
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX is imported

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import autoshard
from autoshard._examples import load_example, load_module, repository_root
from autoshard.emit import global_rel_error
from autoshard.planner.summary import format_plan

ROOT = repository_root()  # the checkout: from here, beside the autoshard package, or $AUTOSHARD_REPO
print(f"jax {jax.__version__}, {len(jax.devices())} devices: {jax.devices()[0].platform}")

# %% [markdown]
# ## The model
#
# `examples/gpt.py` is a GPT-2/3-style decoder written with flax and optax. Like every model file it
# exposes `PRESETS`, `make(preset, ...) -> (state, batch)` and `train_step(state, batch) -> (state,
# metrics)`. The `"tiny"` preset runs a step in well under a second on a CPU.

# %%
gpt = load_module(ROOT / "examples" / "gpt.py")
config = gpt.PRESETS["tiny"]
print(config)
print(f"{gpt.param_count(config):,} parameters")

# %% [markdown]
# ## Parallelize
#
# `autoshard.parallelize` wraps the train step. Its first call traces the step, plans it for the mesh
# and compiles one sharded `jax.jit` program; later calls with the same shapes reuse that program.
# `time_budget_s` caps the ILP solver (the default is 60 s; 10 s is enough for this model, a budget of a
# second or two is not: the solver then returns the best plan it has, which may still pay for needless
# communication).

# %%
step = autoshard.parallelize(gpt.train_step, mesh=(2, 4), hardware="h100", time_budget_s=10)

state, batch = gpt.make("tiny")
for call in range(3):
    t0 = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(state)
    print(f"call {call}: {time.perf_counter() - t0:6.2f} s, loss {float(metrics['loss']):.4f}")

# %% [markdown]
# The first call traces, plans and compiles. The second compiles once more: JAX keys its compilation
# cache on whether the arguments are already committed to devices, and only the first call's state came
# from the host. From the third call on, a step is just the sharded program running.

# %% [markdown]
# ## The plan
#
# `step.explain()` is the readable summary: the mesh and the hardware it was priced for, the predicted
# step time split by category, the predicted peak memory per device, and the layout of each of the
# step's inputs with layer indices folded (`block_*`). A layout is written per tensor dimension: `R`
# replicated, `S(x)` split over mesh axis `x`, `S(x,y)` split over both.

# %%
print(step.explain())

# %% [markdown]
# This model is too small to be worth splitting: on H100s its whole step is about 10 µs of compute, the
# latency of a handful of collectives over NVLink, so the plan keeps (nearly) everything replicated and
# pays little or nothing for communication. The larger model below gets a very different plan.
#
# `step.plan` is the plan as plain data (a frozen dataclass that round-trips through JSON):

# %%
plan = step.plan
print(type(plan).__name__, plan.mesh)
print(f"predicted step time {1e6 * plan.predicted_step_time:.1f} us, peak memory {plan.peak_memory / 2**20:.1f} MiB")
print("time breakdown:", {k: f"{1e6 * v:.2f} us" for k, v in plan.time_breakdown.items()})
for layout in plan.inputs[:6]:
    print(f"  {layout.role:<9} {layout.name:<40} {list(layout.shape)!s:<10} {layout.spec}")
print("solver:", plan.solver.status, plan.solver.nodes, "nodes", plan.solver.edges, "edges")
print("JSON keys:", list(plan.to_dict()))

# %% [markdown]
# The returned train state lives on the 8 devices in the planned layout:

# %%
kernel = state.params["block_0"]["mlp"]["fc"]["kernel"]
print(kernel.shape, kernel.sharding)

# %% [markdown]
# ## Same numbers as `jax.jit`
#
# Run a few steps of the parallelized step and of the plain jitted step from the same initial state and
# compare the losses. (The parallelized step donates its input state, so each side gets its own copy.)

# %%
reference = jax.jit(gpt.train_step)
state_ref, batch = gpt.make("tiny")
state_par = jax.tree.map(jnp.copy, state_ref)

print(f"{'step':>4} {'jax.jit':>10} {'autoshard':>10} {'rel. diff':>10}")
for i in range(4):
    state_ref, m_ref = reference(state_ref, batch)
    state_par, m_par = step(state_par, batch)
    print(f"{i:>4} {float(m_ref['loss']):>10.6f} {float(m_par['loss']):>10.6f} "
          f"{global_rel_error(m_ref['loss'], m_par['loss']):>10.1e}")
opt_err = global_rel_error(state_ref.opt_state, state_par.opt_state)
print(f"Adam moments after 4 steps, global relative error: {opt_err:.1e}")
assert opt_err < 1e-5

# %% [markdown]
# ## Planning for a cluster that is not here
#
# `autoshard.plan` only plans: it needs shapes, not arrays, and a logical mesh, not devices. Here is the
# GPT-3 125M shape (sequence 1024, vocabulary 51200, batch 16) on an 8x8 mesh of H100s: axis `x` crosses
# the 8 hosts over InfiniBand, axis `y` the 8 GPUs of a host over NVLink. `abstract=True` builds the
# train state as `jax.ShapeDtypeStruct`s, so nothing is allocated.

# %%
big = load_example(ROOT / "examples" / "gpt.py", "125m", ["batch=16"], abstract=True)
t0 = time.perf_counter()
plan_8x8 = autoshard.plan(big.train_step, *big.args, mesh="8x8", hardware="h100", time_budget_s=10)
print(f"planned in {time.perf_counter() - t0:.1f} s\n")
print(format_plan(plan_8x8, max_classes=12))

# %% [markdown]
# Now communication shows up in the breakdown, per collective and per mesh axis. Look at how much of it
# goes over `y` (NVLink, inside a host) and how little over `x` (InfiniBand, between hosts, several times
# slower): the cost model prices each axis by its own links, so the planner keeps the heavy traffic on
# the fast one. The plan can be saved as JSON and read back:

# %%
per_axis: dict[str, float] = {}
for category, seconds in plan_8x8.time_breakdown.items():
    if "(" in category:  # "all_gather(y)", "reduce_scatter(x,y)": a collective over those mesh axes
        axes = category[category.index("(") + 1 : -1]
        per_axis[axes] = per_axis.get(axes, 0.0) + seconds
print("collective time by mesh axes:", {a: f"{1e3 * t:.2f} ms" for a, t in sorted(per_axis.items())})

path = Path(tempfile.gettempdir()) / "gpt125m_8x8.json"
plan_8x8.save(path)
again = autoshard.Plan.load(path)
print(f"{path}: {path.stat().st_size / 1e6:.1f} MB; same plan: {again.predicted_step_time == plan_8x8.predicted_step_time}")

# %% [markdown]
# ## A pipelined step
#
# With `microbatches=4, pipeline=True` the step is also cut into pipeline stages. Here every stage gets a
# 1x4 submesh (`stage_shape`), so the 8 devices make two stages; the step is cut into `num_layers=4`
# layers first, and the stage DP decides which layers go to which stage. Each stage is its own compiled
# program on its own four devices; the microbatches run in the schedule the planner prices faster on
# those stages (1F1B, or ZB-H1, which runs each backward's weight-gradient half in 1F1B's idle slots), with
# gradients accumulated over the microbatches before one update. `.plan` is now a `PipelinePlan`.

# %%
pipelined = autoshard.parallelize(gpt.train_step, mesh=(2, 4), hardware="h100", microbatches=4, pipeline=True,
                                  stage_shape=(1, 4), num_layers=4, time_budget_s=3)
state_ref, batch = gpt.make("tiny")
state_pipe = jax.tree.map(jnp.copy, state_ref)
t0 = time.perf_counter()
print(f"{'step':>4} {'jax.jit':>10} {'pipeline':>10} {'rel. diff':>10}")
for i in range(3):
    state_ref, m_ref = reference(state_ref, batch)
    state_pipe, m_pipe = pipelined(state_pipe, batch)
    print(f"{i:>4} {float(m_ref['loss']):>10.6f} {float(m_pipe['loss']):>10.6f} "
          f"{global_rel_error(m_ref['loss'], m_pipe['loss']):>10.1e}")
print(f"(3 steps, planning and compiling included: {time.perf_counter() - t0:.1f} s)\n")
print(type(pipelined.plan).__module__ + "." + type(pipelined.plan).__name__)
print(pipelined.explain())

# %% [markdown]
# The summary lists each stage's layers, its submesh and device ids, its forward+backward time per
# microbatch and its memory per device, and the bubble: the share of the step the devices sit idle
# while the pipeline fills and drains. With 2 stages and 4 microbatches the textbook bubble of a 1F1B
# schedule is (S-1)/(B+S-1) = 1/5 when the stages are balanced; uneven stages idle more, and ZB-H1 fills
# part of it (the summary shows the schedule chosen and what the other would take).
#
# Next: `02_plan_explorer` sweeps meshes and memory budgets and draws layouts and schedules;
# `03_auto_vs_hand` compares the automatic plan with hand-written layouts.
