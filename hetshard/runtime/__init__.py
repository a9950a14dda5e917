"""Executing plans: single-stage SPMD programs (``spmd``) and MPMD pipelines of stage
programs on their submeshes (``pipeline``)."""
