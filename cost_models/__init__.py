"""Hardware descriptions and cost formulas (compute roofline, collectives, memory) for autoshard.
Knows nothing of JAX; measured profiles are data files it loads.

The public surface:

* ``CostModel.load(source, mesh_shape=..., axis_names=...)``: the one loading path, from a preset name
  (``presets.names()``), a profile JSON or a ``Profile``/``Cluster``. It prices compute (``compute_time``,
  ``matmul_time``), collectives (``collective_time``), resharding (``reshard``) and memory
  (``bytes_per_device``, ``memory_capacity``).
* ``ShardingSpec`` (per-dimension mesh axes plus partial-sum axes) and ``LogicalMesh`` (named axes with a
  ``Link`` each), built by ``Cluster.logical_mesh``.
* ``Device``, ``Cluster``, ``Link``: frozen hardware descriptions; ``presets.get(name)``.
* ``Profile`` and ``load_profile``: the measured profile format (``cost_models.profile``).
* ``collectives``: the alpha-beta formulas as pure functions.
"""

from cost_models import collectives, presets
from cost_models.dtypes import dtype_bytes
from cost_models.errors import CostModelError
from cost_models.hardware import Cluster, Device
from cost_models.mesh import Link, LogicalMesh
from cost_models.model import CostModel, ReshardCost
from cost_models.profile import (
    PROFILE_VERSION,
    CollectiveSample,
    CopySample,
    MatmulSample,
    Profile,
    load_profile,
)
from cost_models.reshard import CollectiveStep
from cost_models.spec import ShardingSpec

__all__ = [
    "PROFILE_VERSION",
    "Cluster",
    "CollectiveSample",
    "CollectiveStep",
    "CopySample",
    "CostModel",
    "CostModelError",
    "Device",
    "Link",
    "LogicalMesh",
    "MatmulSample",
    "Profile",
    "ReshardCost",
    "ShardingSpec",
    "collectives",
    "dtype_bytes",
    "load_profile",
    "presets",
]
