"""Event-driven simulator of a Plan, and its trace exports."""

from hetshard.sim.export import chrome_trace, write_chrome_trace, write_timeline_png
from hetshard.sim.schedule import inflight, schedule_order, schedule_walk, steady_period
from hetshard.sim.simulator import SimResult, Task, simulate, upper_bound_tokens_per_s

__all__ = ["SimResult", "Task", "chrome_trace", "inflight", "schedule_order", "schedule_walk",
           "simulate", "steady_period", "upper_bound_tokens_per_s", "write_chrome_trace",
           "write_timeline_png"]
