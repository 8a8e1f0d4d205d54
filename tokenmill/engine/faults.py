"""Fault injection into engine steps, for tests only (``LLMEngine.fault_hook``).

Nothing here runs unless a test sets the hook: in process (``engine.fault_hook = hook``, any
callable ``hook(stage, request_ids)``) or, for a server under test, with the hidden
``tokenmill serve --test-faults SPEC`` flag, which ``FaultPlan.parse`` reads. No HTTP route
reaches it.

The engine calls the hook at each point of a step named in ``STAGES``, with the callers' ids of
the requests in play there (every unfinished request at ``step``, then those the stage
touches); a hook that raises makes that stage fail, one that sleeps makes the step slow.

SPEC: rules separated by ``;``, each ``STAGE:MARK:ACTION``. At STAGE, when a request whose id
contains MARK is in play (an empty MARK: at every step that reaches STAGE), ACTION ``raise``
raises ``InjectedFault`` and ``sleep=SECONDS`` sleeps. The server's engine request ids contain
the client's ``X-Request-Id`` (``cmpl-<id>-<suffix>``), so a test picks the requests a rule
hits, e.g. ``forward:fail-:raise;forward:slow-:sleep=5``.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

# In step order. ``step``: before anything is touched (a failure there blames no request);
# ``sample``: the runner returned (forward and sampling done), its tokens not yet used;
# ``finish``: outputs built, proposer told of ended sequences; ``metrics``: the AsyncEngine's
# timings, listener calls and gauges after the step.
STAGES = ("step", "propose", "schedule", "forward", "sample", "observe", "grammar", "update",
          "process", "finish", "metrics")


class InjectedFault(RuntimeError):
    """Raised by a fault rule (never by the engine itself)."""


@dataclass(frozen=True)
class FaultRule:
    stage: str
    mark: str  # fires when any request id in play contains it ("": always)
    sleep: float | None  # seconds to sleep; None: raise InjectedFault

    def __call__(self, stage: str, request_ids: Collection[str]) -> None:
        if stage != self.stage:
            return
        if self.mark and not any(self.mark in r for r in request_ids):
            return
        if self.sleep is None:
            raise InjectedFault(f"injected fault at {stage} ({sorted(request_ids)})")
        time.sleep(self.sleep)


class FaultPlan:
    """Rules applied in order at every stage (a hook for ``LLMEngine.fault_hook``)."""

    def __init__(self, rules: Collection[FaultRule]) -> None:
        self.rules = tuple(rules)

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Rules from SPEC (see the module docstring); ValueError naming a bad rule."""
        return cls([_parse_rule(part.strip()) for part in spec.split(";") if part.strip()])

    def __call__(self, stage: str, request_ids: Collection[str]) -> None:
        for rule in self.rules:
            rule(stage, request_ids)


def _parse_rule(text: str) -> FaultRule:
    stage, mark, action = (text.split(":", 2) + ["", ""])[:3]
    if stage not in STAGES:
        raise ValueError(f"--test-faults: {text!r}: the stage must be one of {', '.join(STAGES)}")
    if action == "raise":
        return FaultRule(stage, mark, None)
    name, _, seconds = action.partition("=")
    try:
        sleep = float(seconds) if name == "sleep" else -1.0
    except ValueError:
        sleep = -1.0
    if not sleep >= 0:
        raise ValueError(f"--test-faults: {text!r}: the action must be raise or sleep=SECONDS")
    return FaultRule(stage, mark, sleep)
