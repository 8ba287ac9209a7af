"""Presets, mesh-to-link assignment, and the compute roofline."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cost_models import CostModel, CostModelError, presets


def test_every_preset_loads_with_a_cited_docstring() -> None:
    assert set(presets.names()) == {"h100", "h200", "a100", "v100", "tpu-v4", "tpu-v5e", "tpu-v5p", "cpu"}
    for name in presets.names():
        cluster = presets.get(name)
        factory = presets._PRESETS[name]
        assert "Source" in (factory.__doc__ or ""), name
        model = CostModel.load(name)
        assert model.memory_capacity > 0
        assert model.matmul_time(1024, 1024, 1024, "bfloat16") > 0
        assert cluster.intra_link.bandwidth >= cluster.inter_link.bandwidth, name


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(CostModelError, match=r"h100.*tpu-v5p"):
        presets.get("h1000")
    with pytest.raises(CostModelError, match="presets: h100"):
        CostModel.load("h1000")


def test_logical_mesh_assigns_links() -> None:
    c = presets.get("h100", num_hosts=8)
    mesh = c.logical_mesh((8, 8), ("node", "gpu"))
    assert [lk.name for lk in mesh.links] == ["ib", "nvlink"]
    # inner 16 does not fit a host of 8: both axes cross hosts
    assert [lk.name for lk in c.logical_mesh((4, 16)).links] == ["ib", "ib"]
    # (2, 4, 8): the last two (4·8 = 32 > 8) cross hosts
    assert [lk.name for lk in c.logical_mesh((2, 4, 8)).links] == ["ib", "ib", "nvlink"]
    # an axis of 3 inside a host of 8: groups straddle hosts -> the slower link
    assert [lk.name for lk in c.logical_mesh((2, 3)).links] == ["ib", "ib"]
    assert [lk.name for lk in c.logical_mesh((16, 2, 2)).links] == ["ib", "nvlink", "nvlink"]


def test_mesh_larger_than_cluster_says_what_to_do() -> None:
    with pytest.raises(CostModelError, match="num_hosts"):
        presets.get("h100", num_hosts=1).logical_mesh((16, 16))
    # planning a 16x16 mesh needs no devices, only a big enough description
    assert CostModel.load("h100", num_hosts=32, mesh_shape=(16, 16)).mesh.num_devices == 256


def test_v100_p3_inter_node_is_25_gbit_per_node() -> None:
    c = presets.get("v100")
    assert c.inter_link.bandwidth * c.devices_per_host == pytest.approx(25e9 / 8)


def test_roofline_hand_values() -> None:
    m = CostModel.load("a100")
    dev = m.device
    # 8192^3 bf16: 2·8192^3 FLOPs at 312e12·0.8
    t = m.matmul_time(8192, 8192, 8192, "bfloat16")
    assert t == pytest.approx(2 * 8192**3 / (312e12 * 0.8))
    # fp32 dot runs as tf32 on A100
    assert m.matmul_time(8192, 8192, 8192, "float32") == pytest.approx(2 * 8192**3 / (156e12 * 0.8))
    # memory-bound elementwise: bytes / (HBM · efficiency)
    assert m.compute_time(1e6, 4e9, "float32", matmul=False) == pytest.approx(4e9 / (2039e9 * 0.85))
    # a skinny matmul is memory bound
    flops, nbytes = 2 * 1 * 8192 * 8192, (8192 + 8192 * 8192 + 8192) * 2
    assert m.matmul_time(1, 8192, 8192, "bfloat16") == pytest.approx(nbytes / dev.achievable_memory_bandwidth)
    assert flops / dev.achievable_flops("bfloat16") < nbytes / dev.achievable_memory_bandwidth


def test_dtype_rates() -> None:
    v100 = presets.get("v100").device
    assert v100.peak_flops("bfloat16") == v100.flops_fp32  # no bf16 unit
    assert v100.peak_flops("float16") == 125e12
    a100 = presets.get("a100").device
    assert a100.peak_flops("float8_e4m3fn") == a100.peak_flops("float16")  # no fp8 unit
    h100 = presets.get("h100").device
    assert h100.peak_flops("float8_e4m3fn") == pytest.approx(2 * h100.peak_flops("bfloat16"), rel=1e-3)
    assert presets.get("tpu-v5p").device.peak_flops("float32") == 459e12  # one bf16 pass
    with pytest.raises(CostModelError, match="unknown dtype 'float33'"):
        h100.peak_flops("float33")


@given(f=st.floats(0, 1e15), b=st.floats(0, 1e12), df=st.floats(0, 1e15), db=st.floats(0, 1e12))
def test_roofline_monotone(f: float, b: float, df: float, db: float) -> None:
    m = CostModel.load("h100")
    assert m.compute_time(f + df, b + db, "bfloat16") >= m.compute_time(f, b, "bfloat16")
