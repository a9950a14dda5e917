"""Multi-process runs on JAX's own multi-controller runtime (``jax.distributed``).

``init_distributed()`` is a script's first call. Under ``hetshard launch`` it reads the
coordinator, process count and id that the launcher put in the environment
(``HETSHARD_COORDINATOR``, ``HETSHARD_NUM_PROCESSES``, ``HETSHARD_PROCESS_ID``); under
a scheduler JAX knows (SLURM, Open MPI, Kubernetes, cloud TPU/GPU VMs) it lets
``jax.distributed.initialize()`` detect the cluster; in a plain single process it does
nothing. CPU processes use gloo collectives over loopback.

``launch(nprocs, devices_per_proc, command)`` is ``hetshard launch``: it starts the
processes with that many fake CPU devices each (``XLA_FLAGS`` set before JAX starts),
prefixes their output with ``[rank]``, and returns the exit code of the first process
that fails, stopping the others; a process that dies or never arrives makes the others
stop within ``HETSHARD_TIMEOUT_S`` seconds (default 60) through the coordinator's
heartbeat instead of hanging.

``agree(value, what)`` checks that every process computed the same value (a plan's
fingerprint): a mismatch raises ``DistributedError`` on every process.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from hetshard.errors import HetshardError, check_positive

ENV_COORDINATOR = "HETSHARD_COORDINATOR"
ENV_NUM_PROCESSES = "HETSHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "HETSHARD_PROCESS_ID"
ENV_TIMEOUT = "HETSHARD_TIMEOUT_S"
_SCHEDULER_VARS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "KUBERNETES_SERVICE_HOST",
                   "JAX_COORDINATOR_ADDRESS")
_STATE = {"initialised": False}


class DistributedError(HetshardError, RuntimeError):
    """Processes that disagree, never arrive or die."""


def timeout_s() -> int:
    raw = os.environ.get(ENV_TIMEOUT, "60")
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 1:
        raise DistributedError(f"{ENV_TIMEOUT}={raw!r} is invalid; expected a positive "
                               f"number of seconds")
    return value


def init_distributed() -> bool:
    """Initialises ``jax.distributed`` from the environment; True when multi-process.

    Call it before anything else touches JAX devices.
    """
    import jax
    if _STATE["initialised"]:
        return True
    env = os.environ
    if ENV_COORDINATOR in env:
        try:
            nprocs, pid = int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID])
        except (KeyError, ValueError):
            raise DistributedError(
                f"{ENV_COORDINATOR} is set but {ENV_NUM_PROCESSES}/{ENV_PROCESS_ID} are "
                f"missing or not integers (start the script with hetshard launch)") from None
        # Only the CPU backend reads this (its cross-process collectives); asking for the
        # backend here would initialise it too early.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        limit = timeout_s()
        jax.distributed.initialize(env[ENV_COORDINATOR], nprocs, pid,
                                   initialization_timeout=limit,
                                   heartbeat_timeout_seconds=limit)
        _STATE["initialised"] = True
        return True
    if any(v in env for v in _SCHEDULER_VARS):
        jax.distributed.initialize()  # JAX's own cluster detection
        _STATE["initialised"] = True
        return jax.process_count() > 1
    return False


def agree(value: str, what: str = "plan fingerprint") -> None:
    """Raises DistributedError on every process unless all processes hold ``value``."""
    import jax
    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils
    digest = np.frombuffer(hashlib.sha256(value.encode()).digest()[:8], np.int64)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1)
    if len(set(every.tolist())) != 1:
        raise DistributedError(f"processes disagree on the {what}: process "
                               f"{jax.process_index()} has {value[:16]}...; plan once and "
                               f"pass plan= to every process, or make the inputs equal")


# ---- the launcher ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"{prefix}{line.decode(errors='replace')}")
        out.flush()


def launch(nprocs: int, devices_per_proc: int, command: list[str], *, cluster: str | None = None,
           grace_s: float | None = None, out=None) -> int:
    """Runs ``command`` as ``nprocs`` local processes (see the module docstring)."""
    check_positive("nprocs", nprocs, integer=True, where="hetshard launch")
    check_positive("devices_per_proc", devices_per_proc, integer=True, where="hetshard launch")
    if not command:
        raise DistributedError("hetshard launch needs a command after --, e.g. "
                               "hetshard launch --nprocs 2 -- python train.py")
    out = out or sys.stdout
    port = free_port()
    procs = []
    for rank in range(nprocs):
        env = dict(os.environ)
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join(flags + [
            f"--xla_force_host_platform_device_count={devices_per_proc}"])
        env.setdefault("JAX_PLATFORMS", "cpu")
        env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
        env[ENV_NUM_PROCESSES] = str(nprocs)
        env[ENV_PROCESS_ID] = str(rank)
        if cluster:
            env["HETSHARD_CLUSTER"] = cluster
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        threading.Thread(target=_pump, args=(p.stdout, f"[{rank}] ", out),
                         daemon=True).start()
        procs.append(p)
    grace = timeout_s() + 30 if grace_s is None else grace_s
    first_failure = None
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if first_failure is None:
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                first_failure = bad[0][1]
                failed_at = time.monotonic()
                out.write(f"hetshard launch: process {bad[0][0]} exited with {bad[0][1]}; "
                          f"waiting up to {grace:.0f} s for the others to stop\n")
        if all(c is not None for c in codes):
            break
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    out.write(f"hetshard launch: stopping process {r}\n")
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.1)
    return first_failure if first_failure is not None else 0
