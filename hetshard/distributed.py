"""Multi-process runs on JAX's own multi-controller runtime (``jax.distributed``).

``init_distributed()`` is a script's first call. Under ``hetshard launch`` it reads the
coordinator, process count and id that the launcher put in the environment
(``HETSHARD_COORDINATOR``, ``HETSHARD_NUM_PROCESSES``, ``HETSHARD_PROCESS_ID``); under
a scheduler JAX knows (SLURM, Open MPI, Kubernetes, cloud TPU/GPU VMs) it lets
``jax.distributed.initialize()`` detect the cluster; in a plain single process it does
nothing. CPU processes use gloo collectives over loopback.

``launch(nprocs, devices_per_proc, command)`` is ``hetshard launch``: it starts the
processes with that many fake CPU devices each (``XLA_FLAGS`` set before JAX starts),
prefixes their output with ``[rank]``, and returns the exit status of the first process
that fails (128 + N for one killed by signal N); the others are stopped within
``HETSHARD_TIMEOUT_S`` seconds (default 60), and the failing process's Python traceback
is printed again at the end as the cause. A process whose script raises exits at once
(``init_distributed`` installs the hook) rather than waiting in JAX's shutdown barrier.

``agree(value, what)`` checks that every process computed the same value (a plan's
fingerprint): a mismatch raises ``DistributedError`` on every process.
"""

from __future__ import annotations

import collections
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

from hetshard.errors import (
    DistributedError,
    check_positive,
)

ENV_COORDINATOR = "HETSHARD_COORDINATOR"
ENV_NUM_PROCESSES = "HETSHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "HETSHARD_PROCESS_ID"
ENV_TIMEOUT = "HETSHARD_TIMEOUT_S"
ENV_RESTART = "HETSHARD_RESTART"
_SCHEDULER_VARS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "KUBERNETES_SERVICE_HOST",
                   "JAX_COORDINATOR_ADDRESS")
_STATE = {"initialised": False}


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
        sys.excepthook = _fail_fast
        return True
    if any(v in env for v in _SCHEDULER_VARS):
        jax.distributed.initialize()  # JAX's own cluster detection
        _STATE["initialised"] = True
        if jax.process_count() > 1:
            sys.excepthook = _fail_fast
        return jax.process_count() > 1
    return False


def _fail_fast(exc_type, exc, tb) -> None:
    """An uncaught exception in a multi-process run: its traceback, then an immediate exit
    (status 1, 130 for Ctrl-C). A normal exit would enter jax.distributed's shutdown
    barrier, which waits minutes for processes that are themselves waiting on this one."""
    traceback.print_exception(exc_type, exc, tb)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)


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


def from_first(value: str) -> str:
    """Process 0's ``value`` on every process (the text itself, whatever the others
    hold): a plan the planner made under a wall-clock limit can differ between
    processes on a loaded machine, so all of them run the first one's."""
    import jax
    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils
    data = np.frombuffer(value.encode(), np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.asarray(data.size, np.int64)))
    buf = np.zeros(size, np.uint8)
    buf[:min(size, data.size)] = data[:size]
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)
    return got.tobytes().decode()


# ---- the launcher ----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Output:
    """The ranks' output, prefixed ``[rank]``: streamed until a rank fails, after which
    the others' lines are held back (a failing job's survivors print pages of C++ stack
    as they abort) and summarised at the end. Each rank's last lines are kept so the
    failing rank's Python traceback can be shown again as the cause."""

    def __init__(self, out, nprocs: int):
        self.out = out
        self.lock = threading.Lock()
        self.tails = [collections.deque(maxlen=_TAIL_LINES) for _ in range(nprocs)]
        self.failed: int | None = None
        self.held: list[str] = []

    def pump(self, stream, rank: int) -> None:
        for raw in iter(stream.readline, b""):
            line = f"[{rank}] {raw.decode(errors='replace')}"
            if not line.endswith("\n"):
                line += "\n"
            with self.lock:
                self.tails[rank].append(line)
                if self.failed is not None and rank != self.failed:
                    self.held.append(line)
                else:
                    self.out.write(line)
                    self.out.flush()

    def write(self, text: str) -> None:
        with self.lock:
            self.out.write(text)
            self.out.flush()

    def traceback_of(self, rank: int) -> list[str]:
        """The last Python traceback in ``rank``'s output (empty: none)."""
        lines = list(self.tails[rank])
        starts = [i for i, x in enumerate(lines) if "Traceback (most recent call last)" in x]
        return lines[starts[-1]:] if starts else []


_TAIL_LINES = 400
_HELD_SHOWN = 20
_FRAME = re.compile(r"^\[\d+\]\s+@\s+0x")


def exit_status(code: int) -> int:
    """A child's exit status as a shell reports it: 128 + N for a process killed by
    signal N (``Popen`` gives -N)."""
    return 128 - code if code < 0 else code


def _executable(command: list[str]) -> None:
    prog = command[0]
    if os.sep in prog or (os.altsep and os.altsep in prog):
        ok = os.path.isfile(prog) and os.access(prog, os.X_OK)
    else:
        ok = shutil.which(prog) is not None
    if not ok:
        raise DistributedError(f"hetshard launch: command={prog!r} is invalid; expected an "
                               f"executable on PATH or an executable file path (e.g. "
                               f"{sys.executable} train.py)")


def launch(nprocs: int, devices_per_proc: int, command: list[str], *, cluster: str | None = None,
           grace_s: float | None = None, out=None, max_restarts: int = 0) -> int:
    """Runs ``command`` as ``nprocs`` local processes (see the module docstring).

    Returns the exit status of the process that failed first (128 + N for one killed by
    signal N), else 0. Once one fails, the others get ``grace_s`` seconds (default
    ``HETSHARD_TIMEOUT_S``) to stop before they are killed; the failing process's Python
    traceback is then printed again as the cause. With ``max_restarts`` > 0 a failed job
    is started again, every process (the survivors too: a ``jax.distributed`` job has one
    coordinator), up to that many times; ``HETSHARD_RESTART`` tells the processes which
    start they are (0 first), and a script that restores its last checkpoint under
    ``hetshard.jit(elastic=True)`` resumes there with a new plan.

    Raises:
      DistributedError: no command, or a command that is not an executable.
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise DistributedError(f"hetshard launch: --max-restarts={max_restarts!r} is invalid; "
                               f"expected a count of restarts, 0 or more")
    status = 0
    for attempt in range(max_restarts + 1):
        status = _launch_once(nprocs, devices_per_proc, command, cluster=cluster,
                              grace_s=grace_s, out=out, attempt=attempt)
        if status == 0 or attempt == max_restarts:
            return status
        (out or sys.stdout).write(f"hetshard launch: restarting all {nprocs} processes "
                                  f"(restart {attempt + 1} of {max_restarts})\n")
    return status


def _launch_once(nprocs: int, devices_per_proc: int, command: list[str], *,
                 cluster: str | None, grace_s: float | None, out, attempt: int) -> int:
    check_positive("nprocs", nprocs, integer=True, where="hetshard launch")
    check_positive("devices_per_proc", devices_per_proc, integer=True, where="hetshard launch")
    if not command:
        raise DistributedError("hetshard launch needs a command after --, e.g. "
                               "hetshard launch --nprocs 2 -- python train.py")
    _executable(command)
    grace = timeout_s() if grace_s is None else grace_s
    output = _Output(out or sys.stdout, nprocs)
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
        env[ENV_RESTART] = str(attempt)
        if cluster:
            env["HETSHARD_CLUSTER"] = cluster
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        t = threading.Thread(target=output.pump, args=(p.stdout, rank), daemon=True)
        t.start()
        procs.append((p, t))
    first: tuple[int, int] | None = None  # (rank, exit status)
    failed_at = None
    killed: list[int] = []
    while True:
        codes = [p.poll() for p, _ in procs]
        if first is None:
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                first = (bad[0][0], exit_status(bad[0][1]))
                failed_at = time.monotonic()
                with output.lock:
                    output.failed = first[0]
                output.write(f"hetshard launch: process {first[0]} exited with {bad[0][1]}; "
                             f"stopping the others within {grace:.0f} s\n")
        if all(c is not None for c in codes):
            break
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for r, (p, _) in enumerate(procs):
                if p.poll() is None:
                    killed.append(r)
                    os.killpg(p.pid, signal.SIGKILL)
        time.sleep(0.1)
    for _, t in procs:
        t.join(timeout=5)
    if first is None:
        return 0
    _summarise(output, first, killed)
    return first[1]


def _summarise(output: _Output, first: tuple[int, int], killed: list[int]) -> None:
    rank, status = first
    lines = [f"hetshard launch: process {rank} failed first (exit status {status})"]
    tb = output.traceback_of(rank)
    if tb:
        lines.append("; the cause, its traceback:\n")
        lines += tb
    else:
        lines.append(" without a Python traceback"
                     + (" (killed by a signal)" if status > 128 else "") + "\n")
    if killed:
        lines.append(f"hetshard launch: stopped process(es) {killed} that were still "
                     f"running\n")
    if output.held:
        # Native stack frames ("    @     0x7f...") are dropped; the messages stay.
        said = [x for x in output.held if not _FRAME.match(x)][:_HELD_SHOWN]
        lines.append(f"hetshard launch: the other processes printed {len(output.held)} lines "
                     f"after the failure (held back); their messages:\n")
        lines += said
    output.write("".join(lines))
