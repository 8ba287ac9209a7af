"""tests/style_models.py: every style's step runs under jax.jit and trains, and the six styles of the example
GPT are one model (the same parameters, the same losses from the same seed)."""

from __future__ import annotations

import functools
from collections import Counter

import jax
import numpy as np
import pytest
import style_models as sm

STEPS = 3


def params_of(style: sm.Style, state) -> object:
    if isinstance(state, sm.NnxState):
        return state.state[0]  # of (model, optimizer), split together
    return state.params


def leaf_shapes(name: str) -> Counter:
    """The multiset of the parameters' shapes (a scan's stacked [L, ...] leaf counted as L leaves)."""
    style = sm.STYLES[name]
    params = params_of(style, style.make("tiny", abstract=True)[0])
    if name != "scan":
        return Counter(x.shape for x in jax.tree.leaves(params))
    layers = style.PRESETS["tiny"].layers
    rest = Counter(x.shape for k, v in params.items() if k != "blocks" for x in jax.tree.leaves(v))
    return rest + Counter(x.shape[1:] for x in jax.tree.leaves(params["blocks"]) for _ in range(layers))


def leaf_types(tree: object) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [(jax.tree_util.keystr(p), x.shape, x.dtype) for p, x in leaves]


@functools.cache
def losses(name: str) -> tuple[float, ...]:
    style = {**sm.STYLES, **sm.OTHERS}[name]
    state, batch = style.make("tiny")
    abstract = style.make("tiny", abstract=True)
    assert leaf_types(abstract) == leaf_types((state, batch))
    step = jax.jit(style.train_step)
    out = []
    for _ in range(STEPS):
        state, metrics = step(state, batch)  # the same batch each time: the loss must go down
        out.append(float(metrics["loss"]))
    return tuple(out)


# CI trains the example, the numbered children and the scan; every style also plans and runs as the SPMD
# program in test_spmd_program (some with -m slow)
@pytest.mark.parametrize("name", [n if n in ("example", "numbered", "scan") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in (*sm.STYLES, *sm.OTHERS)])
def test_each_style_trains_under_jit(name: str) -> None:
    got = losses(name)
    assert np.all(np.isfinite(got)) and got[0] > got[1] > got[2], got


@pytest.mark.parametrize("name", [n for n in sm.STYLES if n != "example"])
def test_each_style_is_the_example(name: str) -> None:
    """The same parameter shapes, and from the same seed the same losses step by step (float32 rounding:
    the scan's body is compiled apart from the rest)."""
    shapes = [leaf_shapes(n) for n in (name, "example")]
    assert shapes[0] == shapes[1]
    np.testing.assert_allclose(losses(name), losses("example"), rtol=1e-5)


@functools.cache
def tiny_plan(name: str) -> tuple[float, tuple[tuple[str, int], ...]]:
    """The style's tiny preset planned on a 2x4 H100 mesh: its predicted step time and its recompute
    choices (how many blocks take each: the blocks' names differ by style). 6 s a plan: every style's plan
    was the same at 2.5, 4, 6 and 20 s on 2026-11-29 (the scan's 1.27% too), not proven optimal at any."""
    import autoshard

    style = sm.STYLES[name]
    state, batch = style.make("tiny", abstract=True)
    plan = autoshard.plan(style.train_step, state, batch, mesh="2x4", hardware="h100", time_budget_s=6)
    return plan.predicted_step_time, tuple(sorted(Counter(plan.recompute.values()).items()))


@pytest.mark.parametrize("name", [
    *(n if n != "flax_default" else pytest.param(n, marks=pytest.mark.slow)  # Block_i: as the numbered
      for n in sm.STYLES if n not in ("example", "scan")),
    # the scan is planned and emitted unrolled (``PlanOptions.unroll_scans``; kept a scan it priced ~1.5x,
    # its body's stacked residuals written to memory), and then is the example's program but for its
    # weights, which it slices out of the stacked [L, ...] parameters: 24 copies a step the example does not
    # make, 1.3% of this tiny step: copies in XLA's default GPU pipeline too, where the pass that lets a GEMM
    # read a slice in place (xla_gpu_enable_dynamic_slice_fusion) is off. At 1.3B on 8x8 the scan is within
    # 0.1% of the example (benchmarks/plan_styles.py), its recompute the same
    pytest.param("scan", marks=pytest.mark.xfail(strict=True, reason="the unrolled stack's weight slices: "
                                                 "1.3% over the example's step"))])
def test_each_style_plans_as_the_example(name: str) -> None:
    """The plan does not depend on what the blocks are called: the same recompute choice and a predicted step
    time within 1% of the example's (issue #48's styles acceptance; the 1.3B preset on 8x8 is
    ``benchmarks/plan_styles.py``)."""
    got, want = tiny_plan(name), tiny_plan("example")
    assert got[1] == want[1]
    assert abs(got[0] / want[0] - 1) <= 0.01, (got, want)
