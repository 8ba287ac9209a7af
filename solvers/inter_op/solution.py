"""The answer to an inter-operator problem: stages (layer range, submesh), the step time, and search stats."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solvers.inter_op.problem import InterOpProblem

__all__ = ["InterOpSolution", "InterOpStats", "Stage", "pipeline_cost"]


def pipeline_cost(times: np.ndarray | list[float], num_microbatches: int) -> float:
    """Alpa's step time ``Σ_s t_s + (B - 1)·max_s t_s`` of stages with per-microbatch times ``t_s``: the
    stage DP's objective. It equals the simulated 1F1B or GPipe timeline of equal stages and bounds it from
    above otherwise (``solvers.pipeline.simulate``, async; tests/test_solvers.pipeline.py ties the two)."""
    t = np.asarray(times, dtype=np.float64)
    if not np.isfinite(t).all():
        return float("inf")
    return float(t.sum() + (num_microbatches - 1) * t.max()) if t.size else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """Layers ``first_layer..last_layer`` (inclusive) on ``problem.submeshes[submesh]``.

    ``time`` is the per-microbatch stage time; ``memory`` the bytes per device it holds under the
    problem's in-flight rule at its place in the pipeline.
    """

    first_layer: int
    last_layer: int
    submesh: int
    time: float
    memory: float

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer + 1


@dataclass(frozen=True, kw_only=True, slots=True)
class InterOpStats:
    """How the t_max search went.

    ``candidates``: distinct finite stage times (the t_max values Alpa enumerates); ``dp_runs``: DPs
    solved; ``settled``: candidates whose best answer a DP run decided (a run at ``τ`` whose optimum
    has maximum stage time ``t* <= τ`` settles every candidate in ``[t*, τ]``); ``pruned``: candidates
    discarded by the bound ``Φ_lower + (B - 1)·t_max >= best``; ``dp_states``: ``(stage-count class,
    first layer, devices)`` states computed over all runs; ``seconds``: wall time.
    """

    candidates: int
    dp_runs: int
    settled: int
    pruned: int
    dp_states: int
    seconds: float


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class InterOpSolution:
    """Stages in pipeline order, the step time ``cost`` and, when the shapes tile the cluster, a placement.

    ``placement[s]`` is the ``(first host, first device)`` corner of stage ``s``'s submesh, or
    ``placement`` is None when :func:`place_submeshes` could not tile the chosen shapes.
    """

    stages: tuple[Stage, ...]
    cost: float
    stats: InterOpStats
    placement: tuple[tuple[int, int], ...] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def max_stage_time(self) -> float:
        return max(s.time for s in self.stages)

    def submesh_shapes(self, problem: InterOpProblem) -> list[tuple[int, int]]:
        return [problem.submeshes[s.submesh] for s in self.stages]

    def verify(self, problem: InterOpProblem, *, rtol: float = 1e-9) -> None:
        """Raise ValueError unless the stages cover the layers in order, use exactly every device, match
        the tables, fit in memory under the in-flight rule, and ``cost`` is their step time."""
        if not self.stages:
            raise ValueError("a solution needs at least one stage")
        if problem.max_stages is not None and len(self.stages) > problem.max_stages:
            raise ValueError(f"{len(self.stages)} stages exceed max_stages={problem.max_stages}")
        expect = 0
        for s, st in enumerate(self.stages):
            if st.first_layer != expect or st.last_layer < st.first_layer:
                raise ValueError(f"stage {s} covers layers {st.first_layer}..{st.last_layer}; it must start at "
                                 f"layer {expect} and not be empty")
            if not 0 <= st.submesh < problem.num_submeshes:
                raise ValueError(f"stage {s} names submesh {st.submesh}, outside 0..{problem.num_submeshes - 1}")
            expect = st.last_layer + 1
        if expect != problem.num_layers:
            raise ValueError(f"the stages end at layer {expect - 1}; the model has {problem.num_layers} layers")
        used = int(problem.submesh_sizes[[st.submesh for st in self.stages]].sum())
        if used != problem.num_devices:
            raise ValueError(f"the stages' submeshes hold {used} devices; the cluster has {problem.num_devices}")
        times = []
        for s, st in enumerate(self.stages):
            t = float(problem.stage_time[st.first_layer, st.last_layer, st.submesh])
            if not np.isfinite(t) or not np.isclose(t, st.time, rtol=rtol, atol=0.0):
                raise ValueError(f"stage {s}: recorded time {st.time!r}, table says {t!r}")
            mem = problem.stage_memory(st.first_layer, st.last_layer, st.submesh, len(self.stages) - 1 - s)
            if not np.isclose(mem, st.memory, rtol=rtol, atol=0.0):
                raise ValueError(f"stage {s}: recorded memory {st.memory!r}, the in-flight rule gives {mem!r}")
            limit = problem.memory_limit
            if limit is not None and mem > limit * (1 + rtol):
                raise ValueError(f"stage {s} (layers {st.first_layer}..{st.last_layer} on "
                                 f"{problem.submesh_label(st.submesh)}) needs {mem:.6g} bytes per device "
                                 f"> limit {limit:.6g}")
            times.append(t)
        cost = pipeline_cost(times, problem.num_microbatches)
        if not np.isclose(cost, self.cost, rtol=rtol, atol=0.0):
            raise ValueError(f"recorded cost {self.cost!r} differs from the recomputed step time {cost!r}")
        if self.placement is not None:
            from solvers.inter_op.placement import check_placement

            check_placement(problem.cluster, self.submesh_shapes(problem), self.placement)
