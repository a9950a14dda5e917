"""Pytree key paths as the strings hetshard names state leaves by (plan shardings,
checkpoints, error messages)."""

from __future__ import annotations


def path_string(path) -> str:
    """``a/b/3/kernel`` for a pytree key path (NNX's ``value`` wrappers dropped)."""
    parts = []
    for k in path:
        k = getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))
        if str(k) not in ("value", ".value"):
            parts.append(str(k))
    return "/".join(parts)
