"""Profile format and the measured-profile model: round trip, versioning, interpolation, fallbacks."""

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cost_models import (
    CollectiveSample,
    CopySample,
    CostModel,
    CostModelError,
    MatmulSample,
    Profile,
    load_profile,
    presets,
)
from cost_models.profile import Curve, RateTable, fit_link, shipped_profiles


def _profile() -> Profile:
    cluster = presets.get("cpu")
    mesh = cluster.logical_mesh((2, 4), ("x", "y"))
    coll = []
    for n in (1_000, 10_000, 100_000):
        # an exact alpha-beta: 5 us per step, 1e9 B/s
        for axes, sizes in ((("x",), (2,)), (("y",), (4,))):
            p = sizes[0]
            t = (p - 1) * 5e-6 + (p - 1) / p * n / 1e9
            coll.append(
                CollectiveSample(
                    kind="all_gather", axes=axes, axis_sizes=sizes, links=("cpu-shm",), nbytes=n, seconds=t
                )
            )
    return Profile(
        name="synthetic",
        cluster=cluster,
        mesh=mesh,
        matmuls=tuple(
            MatmulSample(m=s, n=s, k=s, dtype="float32", seconds=2 * s**3 / 1e10) for s in (64, 128, 256)
        ),
        copies=tuple(CopySample(nbytes=n, seconds=2 * n / 5e9) for n in (1 << 16, 1 << 20)),
        collectives=tuple(coll),
        overhead=1e-5,
        host={"call": 1e-4, "arg": 5e-7, "put": 2e-4},
        environment={"platform": "cpu"},
    )


def test_round_trip_through_json(tmp_path) -> None:
    p = _profile()
    path = tmp_path / "p.json"
    p.save(path)
    q = load_profile(path)
    assert q.to_dict() == p.to_dict()
    assert json.loads(path.read_text())["version"] == 1


def test_wrong_format_or_version_is_explained(tmp_path) -> None:
    d = _profile().to_dict()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d | {"version": 99}))
    with pytest.raises(CostModelError, match=r"version 99.*autoshard profile"):
        load_profile(path)
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(CostModelError, match="not an autoshard profile"):
        load_profile(path)
    with pytest.raises(CostModelError, match="no preset or profile file"):
        load_profile(tmp_path / "missing.json")


def test_presets_and_files_share_one_loading_path() -> None:
    assert load_profile("h100").cluster == presets.get("h100")
    assert not load_profile("h100").is_measured
    assert CostModel.load(presets.get("a100")).device.name == "a100-sxm-80gb"


def test_measured_points_are_reproduced_and_interpolated() -> None:
    m = CostModel.load(_profile())
    assert m.mesh.shape == (2, 4)
    # at a sample: exactly the sample
    assert m.collective_time("all_gather", 10_000, "y") == pytest.approx(3 * 5e-6 + 0.75 * 10_000 / 1e9)
    # between samples of an affine law: the law itself
    assert m.collective_time("all_gather", 50_000, "y") == pytest.approx(3 * 5e-6 + 0.75 * 50_000 / 1e9)
    # beyond the samples: the fitted slope continues the line
    assert m.collective_time("all_gather", 1e7, "y") == pytest.approx(3 * 5e-6 + 0.75 * 1e7 / 1e9)
    # matmul rate 1e10 inside the measured range
    assert m.matmul_time(128, 128, 128, "float32") == pytest.approx(2 * 128**3 / 1e10)
    # memory bandwidth from the copies: 2·n bytes in 2n/5e9 s
    assert m.memory_bandwidth == pytest.approx(5e9)


def test_unmeasured_queries_fall_back_to_the_analytic_formula() -> None:
    m = CostModel.load(_profile())
    analytic = CostModel.load("cpu", mesh_shape=(2, 4), axis_names=("x", "y"))
    # all_reduce was not measured
    assert m.collective_time("all_reduce", 1e6, "y") == analytic.collective_time("all_reduce", 1e6, "y")
    # bfloat16 matmuls were not measured: roofline with the profile's device
    assert m.matmul_time(512, 512, 512, "bfloat16") == pytest.approx(
        analytic.matmul_time(512, 512, 512, "bfloat16")
    )


def test_fit_link_recovers_alpha_beta() -> None:
    p = _profile()
    link = fit_link(p.collectives, "cpu-shm")
    assert link.latency == pytest.approx(5e-6, rel=1e-6)
    assert link.bandwidth == pytest.approx(1e9, rel=1e-6)


@given(ys=st.lists(st.floats(1e-6, 1.0), min_size=2, max_size=8), q=st.lists(st.floats(0, 1e9), min_size=2))
def test_curves_are_monotone_even_on_noisy_samples(ys: list[float], q: list[float]) -> None:
    xs = [10.0**i for i in range(len(ys))]
    c = Curve.of(xs, ys)
    vals = [c(x) for x in sorted(q)]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(vals))


def test_shipped_profiles_load() -> None:
    for name in shipped_profiles():
        m = CostModel.load(name)
        assert m.profile.is_measured
        assert m.matmul_time(1024, 1024, 1024, "float32") > 0
        assert m.collective_time("all_reduce", 1 << 20, m.mesh.axis_names) > 0


def test_matmul_rates_are_interpolated_by_shape() -> None:
    fast = MatmulSample(m=512, n=512, k=512, dtype="float32", seconds=2 * 512**3 / 1e10)
    thin = MatmulSample(m=64, n=512, k=512, dtype="float32", seconds=2 * 64 * 512 * 512 / 2.5e9)
    table = RateTable.of([fast, thin])
    assert table.rate(512, 512, 512) == pytest.approx(1e10)
    assert table.rate(64, 512, 512) == pytest.approx(2.5e9)
    mid = table.rate(2**7.5, 512, 512)  # halfway in log2 space: geometric mean
    assert mid == pytest.approx((1e10 * 2.5e9) ** 0.5)
    # a thin matmul is priced at the thin rate, not at the rate of a cube of equal FLOPs
    m = CostModel.load(Profile(name="t", cluster=presets.get("cpu"), matmuls=(fast, thin)))
    assert m.matmul_time(64, 512, 512, "float32") == pytest.approx(thin.seconds)
