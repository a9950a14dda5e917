"""Host memory as a tier: what a stage keeps in its host's memory, by name.

A stage's ``offload`` (``hetshard._plan.Stage.offload``) lists any of :data:`OFFLOADS`:

* ``optimizer``: the optimizer's state (every state leaf that is not a parameter: Adam's
  moments, its step count) lives in the host's pinned memory between steps. The update
  runs on the GPU as without offload: the step brings the state in, updates it, and puts
  it back (``jax.device_put`` to and from the ``pinned_host`` memory kind inside the
  jitted step, as MaxText's optimizer offload does), so the GPU holds it only while the
  update runs, layer by layer as XLA schedules the transfers. Priced as those two
  transfers over the host link, both ways at once (``hetshard.cost.stage``).
* ``activations``: the values the stage's remat keeps for the backward (``selective``'s
  weight projections, or a named policy's) are written to host memory in the forward and
  read back in the backward (``jax.checkpoint_policies.save_and_offload_only_these_names``
  / ``offload_dot_with_no_batch_dims``), each transfer behind the layer's compute. It needs
  a remat that keeps values by name (:data:`ACTIVATION_REMATS`).

The cluster spec gives each GPU's host link and each node's host memory
(``hetshard.cluster.spec.Group.host_link`` and ``host_memory_bytes``); a plan whose
offloaded bytes do not fit a node's host memory is priced as not fitting. This module
imports no JAX (plans are read without it).
"""

from __future__ import annotations

from hetshard.errors import SpecError
from hetshard.remat import SAVING

OFFLOADS = ("optimizer", "activations")
# The remats whose kept values can go to the host: those that keep values by name.
ACTIVATION_REMATS = SAVING


def check_offload(value, remat: str, field: str = "offload", where: str = "") -> tuple:
    """``value`` as a tuple of distinct names among :data:`OFFLOADS`, in that order.

    Raises:
      SpecError: anything else, or ``activations`` with a remat that keeps nothing by
        name, naming ``field``, the value and what is accepted.
    """
    names = _names((value,) if isinstance(value, str) else value, field, value,
                   "a list of distinct names among", where)
    if "activations" in names and remat not in ACTIVATION_REMATS:
        raise SpecError(field, value, "'activations' only with a remat that keeps values by "
                                      f"name, one of {ACTIVATION_REMATS} (remat is "
                                      f"{remat!r})", where=where)
    return names


def _names(names, field: str, value, accepted: str, where: str) -> tuple:
    """``names`` in the order of :data:`OFFLOADS`, when they are distinct names of it;
    else a SpecError naming ``field`` and ``value``."""
    if not isinstance(names, (tuple, list)) or any(
            not isinstance(n, str) or n not in OFFLOADS for n in names) or \
            len(set(names)) != len(names):
        raise SpecError(field, value, f"{accepted} {OFFLOADS} (empty or 'none': nothing "
                                      "offloaded)", where=where)
    return tuple(n for n in OFFLOADS if n in names)


def option_text(offload: tuple[str, ...]) -> str:
    """How options and ``--fix`` write an offload: ``none``, ``optimizer``,
    ``optimizer+activations``."""
    return "+".join(offload) or "none"


def parse_option(text, field: str = "offload_options", where: str = "") -> tuple:
    """An offload written as :func:`option_text` writes it, as a tuple of names.

    Raises:
      SpecError: anything else, naming ``field``.
    """
    names = [t.strip() for t in text.split("+") if t.strip() not in ("", "none")] \
        if isinstance(text, str) else None
    return _names(names, field, text, "'none' or distinct names joined by '+' among",
                  where)


# The planner's memory options: a remat alone, or a remat with what it offloads,
# written ``remat@optimizer+activations`` inside the search (the splits compare them
# by one key) and split back into a stage's ``remat`` and ``offload``.
def option_key(remat: str, offload: tuple[str, ...]) -> str:
    return remat if not offload else f"{remat}@{option_text(offload)}"


def split_key(key: str) -> tuple[str, tuple[str, ...]]:
    """``(remat, offload)`` of an :func:`option_key`."""
    remat, _, off = key.partition("@")
    return remat, parse_option(off) if off else ()
