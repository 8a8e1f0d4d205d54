"""Scheduling policies, chosen by name from a registry.

A policy is a sort key over requests: a smaller key is more important. The scheduler serves the
running queue in key order, admits waiting requests in key order, and preempts the running
request with the largest key. Keys never change while a request lives, so queues can cache them.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.request import Request

PolicyKey = Callable[[Request], tuple[float, ...]]

_POLICIES: dict[str, PolicyKey] = {}


def register_policy(name: str) -> Callable[[PolicyKey], PolicyKey]:
    def register(key: PolicyKey) -> PolicyKey:
        _POLICIES[name] = key
        return key

    return register


def get_policy(name: str) -> PolicyKey:
    try:
        return _POLICIES[name]
    except KeyError:
        known = sorted(_POLICIES)
        raise ValueError(f"unknown scheduling policy {name!r}; known: {known}") from None


@register_policy("fcfs")
def fcfs(request: Request) -> tuple[float, ...]:
    """First come, first served; the n sequences of a request in index order."""
    return (request.arrival_time, request.arrival_seq, request.seq_index)


@register_policy("priority")
def priority(request: Request) -> tuple[float, ...]:
    """Lower ``priority`` value first (as in vLLM); ties go to the earlier arrival."""
    return (request.priority, *fcfs(request))
