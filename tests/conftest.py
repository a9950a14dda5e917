"""Test set-up: 8 fake CPU devices stand in for a cluster's GPUs."""

import importlib.util
import os
import pathlib

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)

# The checkout's own zoo as ``hetshard_models``, whatever is installed (as ``models`` was
# found from the checkout before it took its installed name): experiments/hetshard_models.py
# loads models/ under that name.
_SHIM = pathlib.Path(__file__).parent.parent / "experiments" / "hetshard_models.py"
_spec = importlib.util.spec_from_file_location("_hetshard_models_shim", _SHIM)
_spec.loader.exec_module(importlib.util.module_from_spec(_spec))
# XLA CPU's LLVM back end at its lowest optimisation level: the tests' programs are tiny
# and compiled once or twice each, so compiling dominates their time (a third of the
# suite's on 2 cores, measured). The HLO passes (fusion, scheduling, memory) are the same,
# so what the tests check (values, layouts, compiled memory) is unchanged; only the
# machine code is less optimised. Exported: the processes tests start take it too.
# ``HETSHARD_TEST_XLA_OPT=1`` keeps XLA's default.
if os.environ.get("HETSHARD_TEST_XLA_OPT") != "1":
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split()
         if not f.startswith("--xla_backend_optimization_level")]
        + ["--xla_backend_optimization_level=0"])


@pytest.fixture(scope="session", autouse=True)
def _compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the run, shared by the xdist workers and
    the processes tests start: many tests compile the same programs (the same tiny models
    under the same plans), and each compiles once. It lives under the run's temporary
    directory (a fresh one per run: no test reads a program an earlier run compiled) and
    never in the user's own JAX cache. ``HETSHARD_TEST_JAX_CACHE=0`` turns it off."""
    if os.environ.get("HETSHARD_TEST_JAX_CACHE", "1") == "0":
        yield
        return
    root = tmp_path_factory.getbasetemp()
    # xdist: every worker's basetemp sits under the run's own directory
    shared = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder = shared / "xla-cache"
    folder.mkdir(exist_ok=True)
    settings = {"jax_compilation_cache_dir": str(folder),
                "jax_persistent_cache_min_compile_time_secs": 0,
                "jax_persistent_cache_min_entry_size_bytes": -1}
    before = {name: getattr(jax.config, name) for name in settings}
    env_before = {name: os.environ.get(name.upper()) for name in settings}
    for name, value in settings.items():
        jax.config.update(name, value)
        os.environ[name.upper()] = str(value)  # the processes tests start
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    for name, value in env_before.items():
        if value is None:
            os.environ.pop(name.upper(), None)
        else:
            os.environ[name.upper()] = value


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
