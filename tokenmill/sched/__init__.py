"""Scheduling (no torch): token budget, admission, preemption, policies."""

from tokenmill.sched.output import (ScheduledChunk, SchedulerOutput, SchedulerStats, SeqUpdate,
                                    group_by_request)
from tokenmill.sched.policy import get_policy, register_policy
from tokenmill.sched.scheduler import Scheduler

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput", "SchedulerStats", "SeqUpdate",
           "get_policy", "group_by_request", "register_policy"]
