"""benchmarks/gpu_truth_sharded.py (issue #33) on the 8 CPU devices: its collective counter on known programs and
HLO lines, and its rows in ``--quick`` mode have every field. No GPU numbers are asserted here: the GPU's
rows are recorded by a run on the GPU machine (the command is in the script's docstring)."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_truth_sharded as gts

MEMORY = ("xla_temp_bytes", "xla_arg_bytes", "xla_out_bytes", "xla_alias_bytes", "xla_peak_bytes")
SHARDED = (*MEMORY, "predicted_peak_bytes", "hlo_collectives", "plan_collectives", "lower_s", "compile_s",
           "mesh", "case", "preset", "overrides", "case_wall_s")


def test_a_psum_over_the_mesh_is_one_all_reduce() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    f = jax.jit(lambda x: x.sum(), in_shardings=NamedSharding(mesh, P("x")), out_shardings=NamedSharding(mesh, P()))
    hlo = f.lower(jax.ShapeDtypeStruct((8 * 128,), jnp.float32)).compile().as_text()
    assert gts.count_collectives(hlo) == {"all_reduce": {"ops": 1, "values": 1, "bytes": 4}}


def test_a_gathered_array_is_counted_with_its_gathered_bytes() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    f = jax.jit(lambda w: w * 2, in_shardings=NamedSharding(mesh, P("x")), out_shardings=NamedSharding(mesh, P()))
    hlo = f.lower(jax.ShapeDtypeStruct((64, 32), jnp.float32)).compile().as_text()
    assert gts.count_collectives(hlo) == {"all_gather": {"ops": 1, "values": 1, "bytes": 64 * 32 * 4}}


def test_gpu_style_async_and_combined_collectives() -> None:
    """The forms XLA GPU writes: async starts (an all-gather's returns its operands then its results, a
    collective-permute's adds u32 contexts), tuples of combined values, a reduce-scatter inside an async
    wrapper (the wrapper's ``async-start`` is not counted again), and ``-done`` halves (not counted)."""
    hlo = "\n".join([
        "  %all-gather-start = (bf16[4,256]{1,0}, bf16[32,256]{1,0}) all-gather-start(bf16[4,256]{1,0} %p), "
        "channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}",
        "  %all-gather-done = bf16[32,256]{1,0} all-gather-done((bf16[4,256]{1,0}, bf16[32,256]{1,0}) %ag)",
        "  %all-gather-start.1 = ((bf16[4]{0}, f32[8]{0}), (bf16[32]{0}, f32[64]{0})) all-gather-start(...)",
        "  %all-reduce-start = (bf16[1024]{0}, f32[10]{0}) all-reduce-start(bf16[1024]{0} %a, f32[10]{0} %b)",
        "  %all-reduce-done = (bf16[1024]{0}, f32[10]{0}) all-reduce-done(%all-reduce-start)",
        "  %collective-permute-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %x)",
        "  ROOT %reduce-scatter.3 = bf16[128]{0:S(1)} reduce-scatter(bf16[1024]{0} %y), dimensions={0}",
        "  %reduce-scatter-start = ((bf16[1024]{0}), bf16[128]{0}) async-start(bf16[1024]{0} %y), calls=%w",
        "  %fusion = bf16[8]{0} fusion(%all-reduce-done), kind=kLoop, calls=%fused_all-reduce",
    ])
    assert gts.count_collectives(hlo) == {
        "all_gather": {"ops": 2, "values": 3, "bytes": 32 * 256 * 2 + 32 * 2 + 64 * 4},
        "all_reduce": {"ops": 1, "values": 2, "bytes": 1024 * 2 + 40},
        "collective_permute": {"ops": 1, "values": 1, "bytes": 32},
        "reduce_scatter": {"ops": 1, "values": 1, "bytes": 256},
    }


def test_plan_collectives_sum_over_mesh_axes() -> None:
    from types import SimpleNamespace

    plan = SimpleNamespace(collective_counts={"all_reduce(data)": 3, "all_reduce(model)": 2, "all_gather(data)": 1})
    assert gts.plan_collectives(plan) == {"all_reduce": 5, "all_gather": 1}


def _check_sharded(row: dict) -> None:
    assert "error" not in row, row.get("error")
    for k in SHARDED:
        assert k in row, k
    assert row["xla_peak_bytes"] == (row["xla_temp_bytes"] + row["xla_arg_bytes"] + row["xla_out_bytes"]
                                     - row["xla_alias_bytes"])
    assert row["predicted_peak_bytes"] > 0 and row["compile_s"] > 0
    for v in row["hlo_collectives"].values():
        assert set(v) == {"ops", "values", "bytes"} and v["values"] >= v["ops"] > 0


def test_one_tensor_parallel_row_of_the_tiny_gpt(tmp_path: Path) -> None:
    rows: list[dict] = []
    cache = gts.PlanCache(tmp_path / "plans.json")
    gts.sharded_rows("tiny", ["batch=8"], ["tp8"], jax.devices()[:8], cache, 3.0, tmp_path / "rows.jsonl", rows)
    (row,) = rows
    _check_sharded(row)
    assert row["mesh"] == "8" and row["plan_cached"] is False
    assert row["hlo_collectives"]["all_reduce"]["ops"] >= 1  # Megatron's partial sums
    assert set(row["plan_collectives"]) >= {"all_reduce"}
    cached = gts.PlanCache(tmp_path / "plans.json")  # the plan is in the file, under the trace's digest
    key = f"{gts.HARDWARE}:tiny:batch=8:tp8"  # plans are kept per hardware preset
    digest = cached.data[key]["digest"]
    plan, seconds, hit = cached.get(key, digest, lambda: pytest.fail("planned again"))
    assert hit and seconds == 0.0 and plan.peak_memory == row["predicted_peak_bytes"]
    assert "| tiny | tp8 | 8 |" in gts.markdown([gts.env_row(), *rows])


@pytest.mark.slow
def test_quick_run_writes_every_row(tmp_path: Path) -> None:
    """The whole ``--quick`` run (mock and one-device parts; about 3 minutes on 2 cores): every case a row with
    every field, none an error, and the markdown table written."""
    import json

    out, md = tmp_path / "rows.jsonl", tmp_path / "rows.md"
    assert gts.main(["--quick", "--parts", "mock", "one-device", "--time-budget", "3", "--out", str(out),
                     "--md", str(md)]) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    env = rows[0]
    assert env["part"] == "env" and {"date", "device", "jax", "platform"} <= set(env)
    sharded = [r for r in rows if r["part"] == "sharded"]
    assert {r["case"] for r in sharded} >= {"tp8", "zero3", "dp2xtp4", "auto", "pipe-stage0-forward",
                                            "pipe-stage0-backward", "pipe-stage0-update"}
    for r in sharded:
        if r["case"] == "spmd-pipeline" and r.get("error", "").startswith("not available"):
            continue
        _check_sharded(r)
    one = {r["part"]: r for r in rows if r["part"] in ("dispatch", "tick", "scan")}
    assert set(one) == {"dispatch", "tick", "scan"}
    for r in rows:
        if r["part"] in ("dispatch", "tick", "scan"):
            assert "error" not in r and r["median_s"] > 0, r
    scans = [r for r in rows if r["part"] == "scan"]
    assert sorted(r["scan_layers"] for r in scans) == [False, True]
    assert all(r["xla_peak_bytes"] > 0 for r in scans)
    assert "| tiny | zero3 | 8 |" in md.read_text()
