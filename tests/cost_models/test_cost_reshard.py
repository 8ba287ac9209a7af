"""Resharding: which collectives, on how many bytes, and memory per device."""

import pytest

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
