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
# # Plan explorer
#
# Planning needs no devices, so we can ask what autoshard would do on clusters we do not have. This
# notebook plans one model, GPT-3 125M (sequence 1024, vocabulary 51200, batch 16), priced for H100s:
#
# 1. on several mesh shapes, and plots predicted step time (split by category) and memory per device;
# 2. on a 64-device 8x8 mesh under shrinking memory budgets;
# 3. draws the layout of every weight of one transformer block: which device holds which block;
# 4. draws pipeline schedules (GPipe, 1F1B, interleaved 1F1B) as Gantt charts.
#
# Each plan gets a 10 s solver budget so the whole notebook runs in a couple of minutes on a laptop;
# planning for real, give the solver a minute or more (the default is 60 s): with 10 s the plans are
# feasible but not always the best the solver would find.

# %%
import time

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

import autoshard
from autoshard._examples import load_example, repository_root
from autoshard.pipeline import schedule
from cost_models import dtype_bytes

# %matplotlib inline
plt.rcParams.update({"figure.dpi": 90, "axes.spines.top": False, "axes.spines.right": False})
ROOT = repository_root()  # the checkout: from here, beside the autoshard package, or $AUTOSHARD_REPO
GiB = 2**30
TAB10 = plt.get_cmap("tab10")

# %% [markdown]
# ## Trace once
#
# `abstract=True` makes the train state and batch `jax.ShapeDtypeStruct`s: nothing is allocated. The
# traced `Graph` does not depend on the mesh, so one trace serves every plan below.

# %%
example = load_example(ROOT / "examples" / "gpt.py", "125m", ["batch=16"], abstract=True)
t0 = time.perf_counter()
graph = autoshard.trace(example.train_step, *example.args)
print(f"traced in {time.perf_counter() - t0:.1f} s")
print(graph.summary())

# %% [markdown]
# ## Mesh shapes
#
# The same 8 GPUs as one axis of 8 and as a 2x4 mesh, and a 64-GPU cluster as 8x8. The H100 preset has
# 8 GPUs per host on NVLink; a mesh that needs several hosts puts its first (major) axis across hosts
# on InfiniBand. The memory budget is the default: 90% of the 80 GB of an H100.

# %%
SOLVER_S = 10
plans: dict[tuple[str, float | None], autoshard.Plan] = {}


def plan_for(mesh: str, budget: float | str = "auto") -> autoshard.Plan:
    t0 = time.perf_counter()
    p = autoshard.plan(graph, mesh=mesh, hardware="h100", memory_budget=budget, time_budget_s=SOLVER_S)
    print(f"{mesh:>4}  budget {p.memory_budget / GiB:5.2f} GiB  ->  {1e3 * p.predicted_step_time:6.2f} ms, "
          f"{p.peak_memory / GiB:5.2f} GiB per device   (planned in {time.perf_counter() - t0:.0f} s)")
    return p


MESHES = ["8", "2x4", "8x8"]
for mesh in MESHES:
    plans[mesh, None] = plan_for(mesh)

# %% [markdown]
# `time_breakdown` splits the predicted step time into compute and one entry per collective and mesh
# axes (`all_gather(x)`, `reduce_scatter(x,y)` ...), resharding between ops included. Grouping the
# collectives by kind:

# %%
KINDS = ["compute", "all_gather", "reduce_scatter", "all_reduce", "all_to_all"]
COLOURS = {"compute": "#4C72B0", "all_gather": "#DD8452", "reduce_scatter": "#55A868",
           "all_reduce": "#C44E52", "all_to_all": "#8172B3", "other": "#937860"}


def by_kind(p: autoshard.Plan) -> dict[str, float]:
    out = dict.fromkeys([*KINDS, "other"], 0.0)
    for key, seconds in p.time_breakdown.items():
        if key == "resharding":  # already counted inside the collectives' entries
            continue
        kind = key.split("(")[0]
        out[kind if kind in out else "other"] += seconds
    return out


def stacked_times(ax, labels, plan_list):
    bottom = np.zeros(len(plan_list))
    for kind in [*KINDS, "other"]:
        ms = np.array([1e3 * by_kind(p)[kind] for p in plan_list])
        if ms.any():
            ax.bar(labels, ms, bottom=bottom, color=COLOURS[kind], label=kind.replace("_", "-"), width=0.6)
        bottom += ms
    for i, total in enumerate(bottom):
        ax.annotate(f"{total:.1f}", (i, total), ha="center", va="bottom", fontsize=9,
                    xytext=(0, 2), textcoords="offset points")
    ax.set_ylabel("predicted step time (ms)")
    ax.margins(y=0.12)


mesh_plans = [plans[m, None] for m in MESHES]
labels = [f"{m}\n({int(np.prod(p.mesh.shape))} GPUs)" for m, p in zip(MESHES, mesh_plans, strict=True)]
fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[3, 2])
stacked_times(ax_t, labels, mesh_plans)
ax_t.set_title("predicted step time by category")
ax_t.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
ax_m.bar(labels, [p.peak_memory / GiB for p in mesh_plans], color="#64B5CD", width=0.6)
ax_m.axhline(mesh_plans[0].memory_budget / GiB, color="k", ls="--", lw=1)
ax_m.text(0.99, mesh_plans[0].memory_budget / GiB, "budget: 90% of 80 GB", transform=ax_m.get_yaxis_transform(),
          ha="right", va="bottom", fontsize=8)
ax_m.set_ylabel("peak memory per device (GiB)")
ax_m.set_title("predicted peak memory")
fig.suptitle("GPT-3 125M, batch 16, H100: one plan per mesh shape")
fig.tight_layout()
plt.show()

# %% [markdown]
# Eight times the GPUs buys little here: a batch of 16 sequences splits at most 16 ways, so the rest of
# the parallelism has to come from splitting the layers themselves, which costs collectives on every
# layer; for a model this small the planner finds little of that worth doing. Larger models and batches
# give the extra GPUs more to do.

# %% [markdown]
# ## Memory budgets
#
# On the 8x8 mesh, shrink the per-device memory budget. Under a tight budget the planner has to split
# the weights, the Adam moments and the activations across devices (ZeRO/FSDP-style), and pay for the
# gathers that brings. A budget below what any layout can reach is an error naming the tightest moment
# of the step.

# %%
BUDGETS_GIB = [1.25, 2, 4]
for b in BUDGETS_GIB:  # the tightest first: see below
    plans["8x8", b] = plan_for("8x8", b * GiB)
plans["8x8", None] = plan_for("8x8")  # the default budget again, after the tighter ones

# %% [markdown]
# A plan found under a tight budget is also allowed under every looser one, so the best step time known
# at a budget is the minimum over all plans that fit it (the dashed line). The planner remembers the plans
# it found for a graph and starts every later plan of it from those that fit its budget, so planned from
# the tightest budget up, no budget's plan is slower than a tighter budget's. (Planned the other way, from
# 4 GiB down, the 2 and 4 GiB plans once came back at 24 ms where the 1.25 GiB one, which fits them, took
# 17.4 ms: the solver had stopped short of it in its 10 s.) A point above the line is then a looser
# budget's plan that also fits a tighter budget, and is faster there than what was found for it.

# %%
auto = plans["8x8", None]
points = [(auto.memory_budget / GiB, auto)] + [(b, plans["8x8", b]) for b in BUDGETS_GIB]
points.sort(key=lambda bp: bp[0])
budgets = np.array([b for b, _ in points])
times = np.array([1e3 * p.predicted_step_time for _, p in points])
peaks = np.array([p.peak_memory / GiB for _, p in points])
best = [min((t for t, pk in zip(times, peaks, strict=True) if pk <= b), default=np.nan) for b in budgets]

fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
ax_t.plot(budgets, times, "o-", color="#4C72B0", label="plan found at this budget")
ax_t.step(budgets, best, "--", where="post", color="gray", label="best plan that fits")
ax_t.set_xscale("log", base=2)
ax_t.set_xlabel("memory budget per device (GiB)")
ax_t.set_ylabel("predicted step time (ms)")
ax_t.set_ylim(0, 1.15 * times.max())
ax_t.legend(frameon=False, fontsize=9)
ax_t.set_title("step time")
ax_m.plot(budgets, peaks, "o-", color="#64B5CD", label="predicted peak")
ax_m.plot(budgets, budgets, ":", color="k", lw=1, label="budget")
ax_m.set_xscale("log", base=2)
ax_m.set_yscale("log", base=2)
ax_m.set_xlabel("memory budget per device (GiB)")
ax_m.set_ylabel("peak memory per device (GiB)")
ax_m.legend(frameon=False, fontsize=9)
ax_m.set_title("memory")
for ax in (ax_t, ax_m):
    ax.set_xticks(budgets, [f"{b:.3g}" for b in budgets])
    ax.minorticks_off()
ticks = [2.0**k for k in range(-1, 7)]
ax_m.set_yticks(ticks, [f"{t:g}" for t in ticks])
fig.suptitle("GPT-3 125M, batch 16, 8x8 H100: shrinking the memory budget")
fig.tight_layout()
plt.show()

# %% [markdown]
# ## Who holds what
#
# A plan gives every input of the step a `ShardingSpec`: per tensor dimension, the mesh axes it is split
# over (`plan.inputs[i].spec.dims`). A dimension split over axes `(x, y)` is cut into `|x|·|y|` blocks,
# `x` major; a block is held by every device whose coordinates on those axes match it, and is replicated
# over the other axes. Below, every weight of the first transformer block, and the Adam first moment of
# each kernel, is drawn as a grid of its blocks (a vector as one row). The colour says who holds a block: its hue is the block's coordinate on
# the major mesh axis (`x`, the host on the 8x8 mesh), its shade the coordinate on the minor axis (`y`);
# grey is replicated on every device. Small grids are labelled with the device id, or with the mesh
# coordinates when several devices share a block.


# %%
def dim_blocks(axes, mesh) -> list[dict[str, int]]:
    """The blocks of one tensor dimension split over ``axes`` (major first): each block's mesh coordinates."""
    size = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    blocks: list[dict[str, int]] = [{}]
    for a in axes:
        blocks = [{**b, a: i} for b in blocks for i in range(size[a])]
    return blocks


def block_colour(coords: dict[str, int], mesh):
    order = [a for a in mesh.axis_names if a in coords]
    if not order:
        return "#d9d9d9"
    base = np.array(TAB10(coords[order[0]] % 10)[:3])
    if len(order) == 1:
        return tuple(base)
    n = dict(zip(mesh.axis_names, mesh.shape, strict=True))[order[1]]
    t = 0.7 * coords[order[1]] / max(n - 1, 1)  # minor axis: from the full hue towards white
    return tuple((1 - t) * base + t)


def block_label(coords: dict[str, int], mesh) -> str:
    if not coords:
        return f"all {int(np.prod(mesh.shape))}"
    if len(coords) == len(mesh.shape):  # one device
        idx = 0
        for a, n in zip(mesh.axis_names, mesh.shape, strict=True):
            idx = idx * n + coords[a]
        return f"dev {idx}"
    return "·".join(f"{a}{coords[a]}" for a in mesh.axis_names if a in coords)


def draw_layout(ax, layout, mesh) -> None:
    """One weight as a grid of its blocks, coloured by the devices holding them."""
    spec, shape = layout.spec, layout.shape
    dims = list(spec.dims) if len(shape) == 2 else [(), *spec.dims]  # a vector is drawn as one row
    rows, cols = (dim_blocks(axes, mesh) for axes in dims)
    n_blocks = len(rows) * len(cols)
    for r, row in enumerate(rows):
        for c, col in enumerate(cols):
            coords = {**row, **col}
            y = len(rows) - 1 - r
            ax.add_patch(Rectangle((c, y), 1, 1, facecolor=block_colour(coords, mesh), edgecolor="white",
                                   lw=0.8 if n_blocks <= 16 else 0.2))
            if n_blocks <= 16:
                ax.text(c + 0.5, y + 0.5, block_label(coords, mesh), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(0, len(rows))
    ax.set_xticks([])
    ax.set_yticks([])
    held_by = int(np.prod(mesh.shape)) // n_blocks
    spread = ("replicated" if n_blocks == 1 else
              f"{n_blocks} blocks, each on {held_by} device{'s' * (held_by > 1)}")
    name = ("Adam mu of " if ".mu." in layout.name else "") + layout.name.split("block_0.")[-1]
    ax.set_title(f"{name} {list(shape)}\n{spec}: {spread}", fontsize=8)


def draw_block_weights(p: autoshard.Plan, title: str) -> None:
    """block_0's kernels, their Adam first moments, biases and LayerNorm vectors."""
    layouts = {t.name: t for t in p.inputs}
    kernels = ["attn.qkv.kernel", "attn.proj.kernel", "mlp.fc.kernel", "mlp.proj.kernel"]
    grid = [[f"state.params.block_0.{k}" for k in kernels],
            [f"state.opt_state[0].mu.block_0.{k}" for k in kernels],
            [f"state.params.block_0.{k.replace('kernel', 'bias')}" for k in kernels],
            [f"state.params.block_0.{k}" for k in ("ln_1.scale", "ln_1.bias", "ln_2.scale", "ln_2.bias")]]
    fig, axes = plt.subplots(4, 4, figsize=(12, 9), height_ratios=[4, 3, 1, 1])
    for row, names in zip(axes, grid, strict=True):
        for ax, name in zip(row, names, strict=True):
            draw_layout(ax, layouts[name], p.mesh)
    fig.suptitle(title)
    fig.tight_layout()
    plt.show()


def bytes_by_role(p: autoshard.Plan) -> None:
    """Bytes of the step's inputs by role: in all, and held per device under the plan's layouts."""
    size = dict(zip(p.mesh.axis_names, p.mesh.shape, strict=True))
    total: dict[str, float] = {}
    held: dict[str, float] = {}
    for t in p.inputs:
        nbytes = float(np.prod(t.shape)) * dtype_bytes(t.dtype)
        total[t.role] = total.get(t.role, 0.0) + nbytes
        held[t.role] = held.get(t.role, 0.0) + nbytes / np.prod([size[a] for a in t.spec.sharded_axes])
    for role in ("param", "opt_state", "batch"):
        print(f"  {role:<10} {total[role] / 2**20:8.1f} MiB in all, {held[role] / 2**20:8.1f} MiB per device "
              f"(split {total[role] / held[role]:4.1f} ways on average)")


p = plans["2x4", None]
bytes_by_role(p)
draw_block_weights(p, f"block_0 on a 2x4 mesh (default budget): device id = 4·x + y; "
                      f"{1e3 * p.predicted_step_time:.1f} ms, {p.peak_memory / GiB:.1f} GiB per device")

# %% [markdown]
# With room to spare, the big kernels tend to stay whole on every device (the work is split along the
# batch instead) and mostly small vectors are split, where a split costs next to nothing. Under the
# tightest budget on 64 devices something big has to give: the Adam moments (ZeRO-1), the weights
# themselves (ZeRO-3 / FSDP, each device gathering a weight just before it uses it), or the activations.

# %%
tight = min(BUDGETS_GIB)
p = plans["8x8", tight]
bytes_by_role(p)
draw_block_weights(p, f"block_0 on an 8x8 mesh, {tight} GiB budget: "
                      f"{1e3 * p.predicted_step_time:.1f} ms, {p.peak_memory / GiB:.2f} GiB per device")

# %% [markdown]
# ## Pipeline schedules
#
# A schedule is plain data: which stage runs which microbatch's forward (F) or backward (B), in which
# order. `Schedule.simulate(forward_times, backward_times)` replays it with real durations and returns
# when every action starts and ends. Here: 4 stages, 8 microbatches, a backward twice as long as a
# forward. GPipe runs all forwards, then all backwards; 1F1B starts backwards as early as it can, so a
# stage holds the activations of at most `S - s` microbatches instead of all 8, for the same step time;
# interleaved 1F1B gives each stage two smaller model chunks and so shrinks the bubble.

# %%
S, B = 4, 8
FWD, BWD = 1.0, 2.0
schedules = [schedule("gpipe", S, B), schedule("1f1b", S, B), schedule("interleaved-1f1b", S, B, chunks=2)]


def gantt(ax, sched):
    V = sched.num_virtual_stages
    chunk = sched.num_chunks
    sim = sched.simulate([FWD / chunk] * V, [BWD / chunk] * V)
    for a, start in sim.start.items():
        end = sim.end[a]
        colour = TAB10(a.microbatch % 10)
        ax.broken_barh([(start, end - start)], (a.stage - 0.4, 0.8), facecolor=colour,
                       edgecolor="white", lw=0.6, alpha=1.0 if a.kind == "forward" else 0.55,
                       hatch="" if a.kind == "forward" else "///")
        ax.text((start + end) / 2, a.stage, a.label(), ha="center", va="center", fontsize=7 if chunk == 1 else 6)
    inflight = [sched.peak_inflight(s) for s in range(S)]
    unit = "microbatches" if chunk == 1 else f"chunk-microbatches (1/{chunk} size)"
    ax.set_yticks(range(S), [f"stage {s}" for s in range(S)])
    ax.set_ylim(S - 0.5, -0.5)
    ax.set_title(f"{sched.name}{f' ({chunk} chunks per stage)' if chunk > 1 else ''}: step "
                 f"{sim.makespan:g}, bubble {100 * sim.bubble_fraction:.0f}%, peak in-flight {unit} per stage "
                 f"{inflight}", fontsize=9, loc="left")
    return sim


fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 7), sharex=True)
for ax, sched in zip(axes, schedules, strict=True):
    gantt(ax, sched)
axes[-1].set_xlabel("time (one forward = 1)")
fig.legend(handles=[Patch(facecolor="#999999", label="forward (F)"),
                    Patch(facecolor="#999999", alpha=0.55, hatch="///", label="backward (B)")],
           loc="upper right", ncol=2, frameon=False, fontsize=9)
fig.suptitle(f"{S} stages, {B} microbatches, backward = 2 x forward; colour = microbatch", x=0.01,
             ha="left")
fig.tight_layout()
plt.show()

# %% [markdown]
# GPipe and 1F1B take the same time, (B + S - 1)(f + b); their bubble is (S-1)/(B+S-1) = 3/11 of the
# step. What 1F1B saves is memory: stage 0 holds 4 microbatches' activations instead of 8. With two
# chunks per stage the bubble drops to (S-1)/(2B+S-1), at the price of twice as many stage-to-stage sends
# and a peak in flight counted in half-size chunks.
