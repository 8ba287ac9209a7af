"""Resharding: which collectives, on how many bytes, and memory per device."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cost_models import CostModel, ShardingSpec
from cost_models.collectives import collective_time

M = CostModel.load("h100", num_hosts=2, mesh_shape=(2, 8), axis_names=("node", "gpu"))
SHAPE = (1024, 2048)  # float32: 8 MiB in total
FULL = 1024 * 2048 * 4
S = ShardingSpec.parse


def kinds(src: str, dst: str) -> list[tuple[str, tuple[str, ...], float]]:
    r = M.reshard(SHAPE, "float32", S(src), S(dst))
    assert r.time == pytest.approx(sum(s.time for s in r.steps))
    return [(s.kind, s.axes, s.nbytes) for s in r.steps]


def test_free_moves() -> None:
    assert kinds("R·R", "R·R") == []
    assert kinds("R·R", "S(gpu)·R") == []  # slicing is local
    assert kinds("R·R", "S(node)·S(gpu)") == []
    assert kinds("R·R", "R·R +P(gpu)") == []  # one device keeps the value, the others zero
    assert M.reshard_time(SHAPE, "float32", S("S(gpu)·R"), S("S(gpu)·R")) == 0


def test_gather() -> None:
    assert kinds("S(gpu)·R", "R·R") == [("all_gather", ("gpu",), FULL)]
    assert kinds("S(node,gpu)·R", "R·R") == [("all_gather", ("node", "gpu"), FULL)]
    # slice on node first, then gather gpu: the gather's output is half the tensor
    assert kinds("S(gpu)·R", "R·S(node)") == [("all_gather", ("gpu",), FULL / 2)]


def test_all_to_all() -> None:
    assert kinds("S(gpu)·R", "R·S(gpu)") == [("all_to_all", ("gpu",), FULL / 8)]


def test_partial_sums() -> None:
    assert kinds("R·R +P(gpu)", "R·R") == [("all_reduce", ("gpu",), FULL)]
    assert kinds("R·R +P(gpu)", "S(gpu)·R") == [("reduce_scatter", ("gpu",), FULL)]
    assert kinds("R·R +P(gpu)", "R·R +P(gpu)") == []
    assert kinds("R·R", "R·R +P(gpu)") == []  # one device keeps the value, the others hold zeros
    # a split is gathered, never turned into zero-padded pending sums (XLA's partitioner gathers it)
    assert kinds("S(gpu)·R", "R·R +P(gpu)") == [("all_gather", ("gpu",), FULL)]
    # reduce-scatter over gpu, then all-reduce of the smaller block over node
    assert kinds("R·R +P(node,gpu)", "R·S(gpu)") == [
        ("reduce_scatter", ("gpu",), FULL),
        ("all_reduce", ("node",), FULL / 8),
    ]


def test_times_match_collective_formulas() -> None:
    r = M.reshard(SHAPE, "float32", S("R·R +P(node)"), S("R·R"))
    (step,) = r.steps
    expected = collective_time("all_reduce", FULL, [(2, M.mesh.link("node"))])
    assert step.time == pytest.approx(expected)
    assert "all_reduce(node)" in str(r)


def test_slow_axis_costs_more_than_fast_axis() -> None:
    slow = M.reshard_time(SHAPE, "float32", S("R·R +P(node)"), S("R·R"))
    fast = M.reshard_time(SHAPE, "float32", S("R·R +P(gpu)"), S("R·R"))
    assert slow > fast


def test_bytes_per_device() -> None:
    assert M.bytes_per_device(SHAPE, "float32", S("R·R")) == FULL
    assert M.bytes_per_device(SHAPE, "bfloat16", S("S(node)·S(gpu)")) == FULL // 2 // 16
    assert M.bytes_per_device(SHAPE, "float32", S("R·R +P(gpu)")) == FULL  # partial sums are full size
    assert M.bytes_per_device((10,), "float32", S("S(gpu)")) == 2 * 4  # ceil(10/8) = 2 elements
    assert M.bytes_per_device((4, 4), 2, S("R·R")) == 32  # an int dtype is bytes per element


AXES = ("a", "b", "c")
M3 = CostModel.load("h100", num_hosts=2, mesh_shape=(2, 2, 4), axis_names=AXES)


@st.composite
def specs(draw: st.DrawFn) -> ShardingSpec:
    """A random valid spec of a 2-D tensor on the (a=2, b=2, c=4) mesh."""
    places = {a: draw(st.sampled_from(["none", "dim0", "dim1", "partial"])) for a in AXES}
    order = draw(st.permutations(AXES))
    dims = tuple(tuple(a for a in order if places[a] == f"dim{i}") for i in range(2))
    return ShardingSpec(dims=dims, partial=frozenset(a for a in AXES if places[a] == "partial"))


@given(src=specs(), dst=specs(), scale=st.integers(1, 4))
def test_any_reshard_is_priced_and_more_bytes_never_cheaper(
    src: ShardingSpec, dst: ShardingSpec, scale: int
) -> None:
    small = M3.reshard((64, 128), "float32", src, dst)
    big = M3.reshard((64 * scale, 128), "float32", src, dst)
    assert small.time >= 0
    assert big.time >= small.time * (1 - 1e-12)
    assert M3.reshard((64, 128), "float32", src, src).time == 0
    for step in small.steps:
        assert step.kind in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
        assert set(step.axes) <= set(AXES)
    # loose sanity bound: never far beyond gathering everything and reducing every partial sum
    worst = M3.collective_time("all_gather", 64 * 128 * 4, AXES) + M3.collective_time(
        "all_reduce", 64 * 128 * 4, AXES
    )
    assert small.time <= worst * 4
