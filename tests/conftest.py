"""Test set-up: 8 fake CPU devices stand in for a cluster's GPUs."""

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture
def device_only():
    """A calibration whose host dispatches for free: for tests of the device side of the
    simulator (the built-in one prices the host's dispatch, which binds tiny models)."""
    from hetshard.cost.calibration import Calibration, Efficiency
    return Calibration(default=Efficiency(host_task_s=1e-12), source="device only")


@pytest.fixture
def device_only_file(tmp_path):
    """:func:`device_only` as a calibration file (``--calibration``)."""
    import json
    path = tmp_path / "device_only.json"
    path.write_text(json.dumps({"version": 2, "default": {"host_task_s": 1e-12}}))
    return str(path)
