"""Executing plans. ``executable``: a plan compiled for a step (one protocol for SPMD
stages, batch shares and pipelines); ``pipeline``: the MPMD runner (its set-up, state
and gradient sync), with ``ownership`` (which stage updates which state leaf), ``walk``
(one pipeline's tasks in schedule order) and ``stage_fns`` (each stage's jitted
functions); ``precision``: per-GPU compute dtypes and loss scaling."""
