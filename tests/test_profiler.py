"""The profiler measures the 8 CPU devices and writes a profile that cost_models loads back."""

import json

import jax
import pytest

from autoshard.profiler import ProfileConfig, matmul_shapes, run_profile
from cost_models import CostModel, Profile
from cost_models.collectives import KINDS


@pytest.fixture(scope="module")
def tiny_profile() -> Profile:
    config = ProfileConfig.quick(
        mesh_shape=(2, 4),
        matmul_sizes=(64, 128),
        matmul_dtypes=("float32",),
        copy_sizes=(2**12, 2**14),
        collective_sizes=(2**10, 2**13),
        warmup=1,
        repeats=1,
    )
    return run_profile(config)


def test_profile_has_every_measurement(tiny_profile: Profile) -> None:
    assert len(jax.devices()) == 8
    p = tiny_profile
    assert {(s.m, s.n, s.k) for s in p.matmuls} == set(matmul_shapes((64, 128)))
    assert {s.dtype for s in p.matmuls} == {"float32"}
    assert len(p.copies) == 2
    groups = {s.axes for s in p.collectives}
    assert groups == {("x",), ("y",), ("x", "y")}
    assert {s.kind for s in p.collectives} == set(KINDS)
    assert len(p.collectives) == 3 * len(KINDS) * 2
    assert all(s.seconds > 0 for s in (*p.matmuls, *p.copies, *p.collectives))
    assert p.mesh is not None and p.mesh.shape == (2, 4) and p.mesh.axis_names == ("x", "y")
    assert p.environment["platform"] == "cpu"
    # the host costs of the single-process pipeline runtime (``pipeline.host``)
    assert set(p.host) == {"call", "arg", "put"} and p.host["call"] > 0 and p.host["put"] > 0


def test_profile_round_trips_and_drives_a_cost_model(tiny_profile: Profile, tmp_path) -> None:
    path = tmp_path / "p.json"
    tiny_profile.save(path)
    data = json.loads(path.read_text())
    assert data["format"] == "autoshard-profile" and data["version"] == 1
    model = CostModel.load(path)
    assert model.mesh.shape == (2, 4)
    assert model.profile.host == tiny_profile.host
    s = next(s for s in tiny_profile.collectives if s.kind == "all_gather" and s.axes == ("y",))
    # a measured size is reproduced (made monotone: the least time measured at this size or above)
    assert model.collective_time("all_gather", s.nbytes, "y") == pytest.approx(
        min(x.seconds for x in tiny_profile.collectives if x.key == s.key and x.nbytes >= s.nbytes)
    )
    assert model.matmul_time(128, 128, 128, "float32") > 0
    # fitted device rate is that of the largest measured matmul
    largest = max(tiny_profile.matmuls, key=lambda m: m.flops)
    assert model.device.flops_fp32 == pytest.approx(largest.flops / largest.seconds)


def test_cli_profile_parser() -> None:
    from autoshard.cli import build_parser

    args = build_parser().parse_args(["profile", "--mesh", "2x4", "--quick", "-o", "x.json"])
    assert args.command == "profile" and args.mesh == "2x4" and args.quick and args.output == "x.json"
