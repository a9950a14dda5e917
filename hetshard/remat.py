"""Remat policies: what a checkpointed layer keeps for its backward, by name.

A stage's ``remat`` (``hetshard._plan.Stage.remat``) is one of :data:`REMATS`:

* ``none``: every value the backward reads is kept;
* ``selective``: the matmuls without batch dimensions are kept (JAX's
  ``dots_with_no_batch_dims_saveable``: every weight projection), the rest recomputed;
* the named policies of :data:`POLICIES` keep only some projections' outputs, the rest
  recomputed: ``save_qkv`` the query, key and value projections; ``save_qkv_out`` those
  and the attention output projection; ``save_qkv_mlp`` those and the MLP's input
  projections (up and gate); ``save_qkv_out_mlp`` all three (everything ``selective``
  keeps but the MLP's output projection);
* ``full``: nothing is kept but the layer's input.

A projection's role is read off the layer's forward data flow (:func:`projection_roles`),
the same way in the cost model's traced graph (``hetshard.ir.graph.OpGraph.saved``) and in
the runtime's re-evaluated jaxpr (``hetshard.rewrite.pipeline.remat_wrap``), so what is
priced is what runs. This module imports no JAX (plans are read without it).
"""

from __future__ import annotations

from collections.abc import Sequence

from hetshard.errors import SpecError

PROJECTIONS = ("qkv", "attn_out", "mlp_in")
POLICIES = {
    "save_qkv": ("qkv",),
    "save_qkv_out": ("qkv", "attn_out"),
    "save_qkv_mlp": ("qkv", "mlp_in"),
    "save_qkv_out_mlp": ("qkv", "attn_out", "mlp_in"),
}
# From most kept to least: none, selective, the named policies, full.
REMATS = ("none", "selective", *POLICIES, "full")
# The remats that keep some values and recompute the rest (priced from the graph).
SAVING = ("selective", *POLICIES)

# A node's kind for projection_roles.
WEIGHT, ATTENTION, OTHER = "weight", "attention", "other"


def check_remat(value, field: str = "remat", where: str = "") -> str:
    """``value`` when it is one of :data:`REMATS`.

    Raises:
      SpecError: any other value, naming ``field`` and the names accepted.
    """
    if not isinstance(value, str) or value not in REMATS:
        raise SpecError(field, value, f"one of {REMATS}", where=where)
    return value


def kept_projections(remat: str) -> tuple[str, ...] | None:
    """The projection roles a named policy keeps; None for the other remats."""
    return POLICIES.get(remat)


def projection_roles(kinds: Sequence[str], preds: Sequence[Sequence[int]]) -> dict[int, str]:
    """Each weight projection's role in one layer's forward: node ``i`` is ``kinds[i]``
    (:data:`WEIGHT`: a matmul without batch dimensions; :data:`ATTENTION`: attention,
    a named call or a product batched over heads; :data:`OTHER`), reading the earlier
    nodes ``preds[i]`` (nodes in program order). Paths are followed through ``OTHER``
    nodes only (reshapes, rotary embeddings, norms, activations, residual adds), never
    through another projection:

    * ``qkv``: a projection whose output reaches attention;
    * ``attn_out``: one whose input comes from attention;
    * ``mlp_in``: one whose output reaches another projection (the MLP's up and gate
      projections, through the activation).

    Other projections (an MLP's output projection, a head) have no role. Returns
    node index -> role."""
    n = len(kinds)
    succ: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for p in ps:
            succ[p].append(i)

    def ahead(target: str) -> list[bool]:
        out = [False] * n
        for i in range(n - 1, -1, -1):
            out[i] = any(kinds[j] == target or (kinds[j] == OTHER and out[j])
                         for j in succ[i])
        return out

    to_attention, to_weight = ahead(ATTENTION), ahead(WEIGHT)
    from_attention = [False] * n
    for i in range(n):
        from_attention[i] = any(kinds[p] == ATTENTION or (kinds[p] == OTHER and
                                                          from_attention[p])
                                for p in preds[i])
    roles = {}
    for i, kind in enumerate(kinds):
        if kind != WEIGHT:
            continue
        if to_attention[i]:
            roles[i] = "qkv"
        elif from_attention[i]:
            roles[i] = "attn_out"
        elif to_weight[i]:
            roles[i] = "mlp_in"
    return roles
