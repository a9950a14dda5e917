"""Executing plans: SPMD single-stage programs (pipelines: planned, not yet executable)."""
