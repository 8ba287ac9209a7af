"""ShardingSpec: printing, parsing, validation, per-device shapes."""

import pytest

from cost_models import CostModelError, Link, LogicalMesh, ShardingSpec

MESH = LogicalMesh.uniform((2, 4), ("data", "model"), Link(name="l", bandwidth=1e9, latency=1e-6))


def test_str_and_parse_round_trip() -> None:
    spec = ShardingSpec(dims=(("data",), (), ("model",)), partial=frozenset())
    assert str(spec) == "S(data)·R·S(model)"
    p = ShardingSpec(dims=(("data", "model"), ()), partial=frozenset({"x"}))
    assert str(p) == "S(data,model)·R +P(x)"
    for s in (spec, p, ShardingSpec.replicated(0), ShardingSpec.replicated(3)):
        assert ShardingSpec.parse(str(s)) == s
        assert ShardingSpec.from_dict(s.to_dict()) == s
    assert ShardingSpec.parse("S(data).R") == ShardingSpec(dims=(("data",), ()))
    assert str(ShardingSpec.replicated(0)) == "()"


def test_axis_used_twice_is_rejected() -> None:
    with pytest.raises(CostModelError, match="'data' more than once"):
        ShardingSpec(dims=(("data",), ("data",)))
    with pytest.raises(CostModelError, match="more than once"):
        ShardingSpec(dims=(("data",),), partial=frozenset({"data"}))


def test_unknown_axis_names_axis_and_mesh_axes() -> None:
    spec = ShardingSpec(dims=(("expert",), ()))
    with pytest.raises(CostModelError, match=r"'expert'.*\('data', 'model'\)"):
        spec.validate((8, 8), MESH)


def test_wrong_rank_and_divisibility() -> None:
    with pytest.raises(CostModelError, match="2 dimensions"):
        ShardingSpec(dims=(("data",), ())).validate((8,), MESH)
    with pytest.raises(CostModelError, match="not divisible"):
        ShardingSpec(dims=(("model",),)).validate((6,), MESH, require_divisible=True)


def test_shard_shape_uses_ceil_for_non_divisible() -> None:
    assert ShardingSpec(dims=(("data",), ("model",))).shard_shape((8, 16), MESH) == (4, 4)
    assert ShardingSpec(dims=(("data", "model"),)).shard_shape((10,), MESH) == (2,)  # ceil(10/8)
    assert ShardingSpec(dims=((), ("model",))).shard_shape((3, 6), MESH) == (3, 2)  # ceil(6/4)


def test_queries() -> None:
    spec = ShardingSpec(dims=(("data",), ()), partial=frozenset({"model"}))
    assert spec.axes_used == {"data", "model"}
    assert spec.sharded_axes == ("data",)
    assert spec.dim_of("data") == 0 and spec.dim_of("model") is None
    assert spec.replicated_axes(MESH) == ()
    assert ShardingSpec.replicated(2).replicated_axes(MESH) == ("data", "model")
    assert ShardingSpec.replicated(2).is_replicated()


def test_specs_equal_by_value_hash_alike_and_keep_their_form() -> None:
    """A spec derives its hash and axes once (the problem builder hashes the same specs millions of times):
    equal specs built apart are equal and hash alike, the derived fields show nowhere, and a spec survives
    pickling (to a forked solver) and ``dataclasses.replace``."""
    import dataclasses
    import pickle

    a = ShardingSpec(dims=(("x",), ()), partial=frozenset({"y"}))
    b = ShardingSpec.parse("S(x)·R +P(y)")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != ShardingSpec(dims=(("x",), ())) and a.axes_used == {"x", "y"} and a.sharded_axes == ("x",)
    assert repr(a) == "ShardingSpec(dims=(('x',), ()), partial=frozenset({'y'}))"
    assert pickle.loads(pickle.dumps(a)) == a
    c = dataclasses.replace(a, partial=frozenset())
    assert c == ShardingSpec(dims=(("x",), ())) and hash(c) == hash(ShardingSpec(dims=(("x",), ())))
    assert c.axes_used == {"x"} and not ShardingSpec.replicated(2).axes_used
