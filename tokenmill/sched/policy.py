"""Scheduling policies, chosen by name from a registry.

A policy is a sort key over requests: a smaller key is more important. The scheduler serves the
running queue in key order, admits waiting requests in key order, and preempts the running
request with the largest key. Keys never change while a request lives, so queues can cache them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

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


# Sorting the waiting queue by cache hit costs a tree walk per request per step; beyond this many
# waiting requests ``lpm`` admits in FCFS order instead (as SGLang does).
LPM_MAX_WAITING = 128


@register_policy("lpm")
def lpm(request: Request) -> tuple[float, ...]:
    """Longest prefix match: the static order is FCFS; admission reorders the waiting queue by
    cached prefix length (``longest_prefix_first``), which changes as the cache does."""
    return fcfs(request)


def is_prefix_aware(name: str) -> bool:
    return name == "lpm"


def longest_prefix_first(waiting: Iterable[Request],
                         cached_len: Callable[[Request], int]) -> list[Request]:
    """Longest cached prefix first; equal hits keep their queue (FCFS) order."""
    return sorted(waiting, key=lambda r: -cached_len(r))
