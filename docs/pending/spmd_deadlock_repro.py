"""With docs/pending/issue46-item1-cost-fit.patch applied, this aborts after 40 s (a collective-permute where 4 of
8 devices arrive): ``AUTOSHARD_CACHE_DIR=off python docs/pending/spmd_deadlock_repro.py``. On main it runs."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import autoshard
from autoshard._examples import load_example

ex = load_example("examples/gpt.py", "tiny", [], abstract=False)
state, batch = ex.args
step = autoshard.parallelize(ex.train_step, time_budget_s=5, mesh=(2, 4), microbatches=2, pipeline=True,
                             stage_shape=(1, 4), runtime="spmd")
for _ in range(3):
    state, metrics = step(state, batch)
    print(float(metrics["loss"]))
