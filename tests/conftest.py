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
