"""Data-aware planning: each global batch of variable-length (and multimodal) samples
gets its own packing, placement, context degrees and micro-steps on the static plan's
GPU groups (``hetshard.data.planner``), and the packed arrays a model with segment ids
trains on (``hetshard.data.packing``). See docs/data-aware.md."""

from hetshard.data.drafts import BatchPlan, GroupPlan, MicroStep
from hetshard.data.packing import (
    IMAGE_TOKEN,
    Row,
    geometric_buckets,
    pack,
    packed_arrays,
    target_count,
)
from hetshard.data.pipelines import (
    PipelineCost,
    StageRate,
    choose_image_slots,
    identical_pipelines,
    image_slots_from,
    pipeline_bound,
    pipeline_costs,
    plan_pipeline_batch,
)
from hetshard.data.planner import (
    METHODS,
    GroupCost,
    choose_groups,
    group_costs,
    identical,
    lower_bound,
    plan_batch,
)
from hetshard.data.runner import (
    micro_step_plan,
    pass_plan,
    run_batch_plan,
    run_pipeline_batch_plan,
)

__all__ = ["IMAGE_TOKEN", "METHODS", "BatchPlan", "GroupCost", "GroupPlan", "MicroStep", "Row",
           "choose_groups", "geometric_buckets", "group_costs", "identical", "lower_bound", "pack",
           "micro_step_plan", "packed_arrays", "plan_batch", "run_batch_plan", "target_count",
           "PipelineCost", "StageRate", "choose_image_slots", "identical_pipelines",
           "image_slots_from", "pipeline_bound", "pipeline_costs",
           "plan_pipeline_batch", "pass_plan", "run_pipeline_batch_plan"]
