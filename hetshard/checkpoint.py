"""Checkpoints of a training run on top of ``orbax.checkpoint``: the train state, the step,
the data position and the plan, saved asynchronously and atomically, restored straight
into another plan's layout.

* **Atomic and asynchronous** (Orbax's ``CheckpointManager``): a save writes into a
  temporary directory in a background thread and renames it into place when every array
  is on disk, so a process killed mid-save leaves the previous checkpoint as the latest.
  The last ``keep`` checkpoints are kept.
* **Verified**: once a save has landed, hetshard writes a manifest of its files (size
  and CRC-32 of each). A restore checks it first: a changed, truncated or missing file is
  a :class:`CheckpointCorruptError` naming the step and the file, and ``restore()``
  without a step falls back to the newest checkpoint that verifies (a warning names the
  one it skipped).
* **Restore into any plan**: each array is read from disk straight into the sharding it
  will have (``shardings``: by default those the given objects' arrays already have;
  ``hetshard.jit(...).state_shardings(*args)`` gives a plan's layout, single-stage or
  pipeline, where each stage holds only its own state), never gathered onto one device.

The state is what the step updates: NNX objects (a model, an ``nnx.Optimizer``, a tuple
of them) or a pytree of arrays.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import warnings
import zlib

import jax
import numpy as np
from flax import nnx

from hetshard._plan import Plan
from hetshard.autodiff import is_graph
from hetshard.errors import CheckpointCorruptError, CheckpointError, HetshardError, SpecError  # noqa: F401 (re-exported)

MANIFEST = "hetshard-manifest.json"
_TMP_MARK = "orbax-checkpoint-tmp"  # Orbax's name for a save not yet renamed into place


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore` read besides the state."""

    step: int
    data_position: object
    plan: object  # a hetshard.Plan, or None when none was saved
    skipped: tuple[int, ...] = ()  # newer steps that did not verify


def _graph_state(state):
    """(pure pytree to save, how to write a restored one back) of ``state``."""
    objs = state if isinstance(state, tuple) else (state,)
    if objs and all(is_graph(o) for o in objs):
        st = nnx.state(objs)
        return nnx.to_pure_dict(st), lambda pure: (nnx.replace_by_pure_dict(st, pure),
                                                nnx.update(objs, st))[-1]
    return state, None


def _crc(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: str) -> dict[str, list[int]]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in sorted(names):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if not rel.startswith(MANIFEST):
                out[rel] = [os.path.getsize(full), _crc(full)]
    return out


class Checkpointer:
    """Saves and restores a run's checkpoints under ``directory`` (see the module
    docstring). ``keep``: how many to keep (the newest); ``async_save``: write in the
    background (``wait()`` blocks until the last save has landed)."""

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, async_save: bool = True):
        import orbax.checkpoint as ocp
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise SpecError("keep", keep, "a positive number of checkpoints to keep")
        directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise SpecError("directory", directory, "a directory (this is a file)")
        self.directory = directory
        self._ocp = ocp
        self._manager = ocp.CheckpointManager(
            directory, options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True))

    # ---- saving ------------------------------------------------------------------------
    def save(self, step: int, state, *, data_position=None, plan=None) -> None:
        """Starts saving ``state`` as checkpoint ``step`` (with ``data_position``, any
        JSON value, and ``plan``, a hetshard.Plan); returns before the arrays are on disk
        when asynchronous."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise SpecError("step", step, "a non-negative integer")
        try:
            json.dumps(data_position)
        except TypeError:
            raise SpecError("data_position", type(data_position).__name__,
                            "a JSON value (numbers, strings, lists, dicts)") from None
        pure, _ = _graph_state(state)
        meta = {"step": int(step), "data_position": data_position,
                "plan": plan.to_dict() if plan is not None else None}
        self._seal()
        args = self._ocp.args
        self._manager.save(int(step), args=args.Composite(
            state=args.StandardSave(pure), meta=args.JsonSave(meta)))

    def wait(self) -> None:
        """Blocks until every started save has landed (and is sealed by its manifest)."""
        self._manager.wait_until_finished()
        self._seal()

    def close(self) -> None:
        self.wait()
        self._manager.close()

    def _seal(self) -> None:
        """Manifests for the landed checkpoints that have none (process 0 writes them:
        every process sees the same directory)."""
        if jax.process_index() != 0:
            return
        for step in self._manager.all_steps():
            root = self._step_dir(step)
            path = os.path.join(root, MANIFEST)
            if os.path.isdir(root) and not os.path.exists(path):
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(_files(root), f)
                os.replace(tmp, path)

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # ---- restoring ---------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The landed checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        s = self.steps()
        return s[-1] if s else None

    def verify(self, step: int) -> None:
        """Raises :class:`CheckpointCorruptError` when checkpoint ``step``'s files are not
        those its manifest records (a checkpoint that landed without one, its writer
        killed in between, is checked by reading it)."""
        root = self._step_dir(step)
        path = os.path.join(root, MANIFEST)
        if not os.path.exists(path):
            return
        try:
            with open(path) as f:
                want = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointCorruptError(step, MANIFEST, f"unreadable ({e})") from None
        have = _files(root)
        for rel, (size, crc) in want.items():
            got = have.get(rel)
            if got is None:
                raise CheckpointCorruptError(step, rel, "missing")
            if got[0] != size:
                raise CheckpointCorruptError(step, rel, f"{got[0]} bytes, saved {size}")
            if got[1] != crc:
                raise CheckpointCorruptError(step, rel, "contents changed (CRC-32)")

    def restore(self, state, *, step: int | None = None, shardings=None) -> Restored:
        """Reads checkpoint ``step`` (None: the newest that verifies) into ``state``, NNX
        objects updated in place (a pytree state: :meth:`restore_tree`). Each array goes
        straight to its sharding in ``shardings`` (a pytree like the state's, e.g.
        ``hetshard.jit(...).state_shardings(*args)``), by default the sharding the
        corresponding array in ``state`` already has.

        Raises:
          CheckpointError: no checkpoint in the directory, or ``step`` not among them.
          CheckpointCorruptError: ``step`` given and corrupt (without ``step``, corrupt
            ones are skipped with a warning, and this is raised only if none verifies).
        """
        pure, write_back = _graph_state(state)
        got, restored = self._restore(pure, step, shardings)
        if write_back is not None:
            write_back(got)
        return restored

    def restore_tree(self, tree, *, step: int | None = None, shardings=None):
        """As :meth:`restore` for a pytree state: ``(restored pytree, Restored)``."""
        return self._restore(tree, step, shardings)

    def interrupted(self) -> dict[int, str]:
        """Saves that never landed: step -> the temporary directory Orbax left (its
        writer killed before the rename). Such a directory is no checkpoint."""
        found = {}
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(
                self.directory) else []:
            head, dot, tail = name.partition(".")
            if dot and head.isdigit() and tail.startswith(_TMP_MARK):
                found[int(head)] = os.path.join(self.directory, name)
        return found

    def _restore(self, pure, step, shardings):
        for s, path in self.interrupted().items():
            warnings.warn(f"an interrupted save of step {s} left {path}: it is no "
                          f"checkpoint and is not restored (remove it with rm -r "
                          f"{shlex.quote(path)} once no process is saving)", stacklevel=4)
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        if step is not None and step not in steps:
            raise SpecError("step", step, f"one of the checkpoints {steps}")
        target = self._target(pure, shardings)
        order = [step] if step is not None else steps[::-1]
        skipped = []
        for s in order:
            try:
                self.verify(s)
                args = self._ocp.args
                out = self._manager.restore(s, args=args.Composite(
                    state=args.StandardRestore(target), meta=args.JsonRestore()))
            except CheckpointCorruptError as e:
                if step is not None:
                    raise
                warnings.warn(f"{e}; trying the previous checkpoint", stacklevel=3)
                skipped.append(s)
                continue
            except Exception as e:  # noqa: BLE001 -- orbax/tensorstore read errors
                if step is not None:
                    raise CheckpointCorruptError(s, "(arrays)", f"unreadable: {e}") from e
                warnings.warn(f"checkpoint step {s} is unreadable ({type(e).__name__}: "
                              f"{e}); trying the previous checkpoint", stacklevel=3)
                skipped.append(s)
                continue
            meta = out["meta"]
            plan = None
            if meta.get("plan") is not None:
                plan = Plan.from_dict(meta["plan"])
            return out["state"], Restored(int(meta["step"]), meta.get("data_position"),
                                          plan, tuple(skipped))
        raise CheckpointCorruptError(
            skipped[0], "(every checkpoint)", "none verifies",
            message=f"no checkpoint in {self.directory} can be restored: steps "
                    f"{', '.join(map(str, skipped))} are each corrupt or unreadable (the "
                    f"warnings above say how)")

    @staticmethod
    def _target(pure, shardings):
        """The restore target: each leaf's shape and dtype, and its sharding."""
        leaves, tree = jax.tree.flatten(pure)
        if shardings is None:
            shards = [getattr(x, "sharding", None) for x in leaves]
        else:
            shards = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(
                s, jax.sharding.Sharding))
            if len(shards) != len(leaves):
                raise SpecError("shardings", f"{len(shards)} leaves",
                                f"one sharding per state leaf ({len(leaves)})")
        return jax.tree.unflatten(tree, [
            jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s)
            for x, s in zip(leaves, shards, strict=True)])
