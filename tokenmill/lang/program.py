"""``@function``: a Python function over a program state, run once or over a batch."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokenmill.lang.backend import Endpoint
from tokenmill.lang.state import ProgramState

_default: list[Endpoint] = []  # set_default_backend's endpoint (a list: no global statement)


def set_default_backend(endpoint: Endpoint) -> None:
    """The endpoint programs run on when ``run`` is given none."""
    _default[:] = [endpoint]


def _backend(given: Endpoint | None) -> Endpoint:
    if given is not None:
        return given
    if not _default:
        raise RuntimeError("no backend: pass backend=Endpoint(url) to run, or call "
                           "set_default_backend(Endpoint(url)) first")
    return _default[0]


class Program:
    """A ``@function``: ``fn(s, *args, **kwargs)`` writes to ``s``; ``run`` gives it a fresh
    state and returns that state."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def run(self, *args: Any, backend: Endpoint | None = None, stream: bool = False,
            **kwargs: Any) -> ProgramState:
        """Runs the program. Without ``stream`` it returns once every call is done (a failure
        raises ``ProgramError``); with it, at once: read ``state.text_iter()``."""
        state = ProgramState(_backend(backend), stream=stream)
        try:
            self.fn(state, *args, **kwargs)
        finally:
            state._finish()
        if not stream:
            state.sync()
        return state

    def run_batch(self, batch: Sequence[dict[str, Any]], backend: Endpoint | None = None,
                  num_threads: int = 16) -> list[ProgramState]:
        """Runs the program once per keyword dict of ``batch``, up to ``num_threads`` at a
        time (their requests batch together on the server); states come back in order. A
        failed run's state raises from its ``sync()`` / reads instead of stopping the rest."""
        endpoint = _backend(backend)

        def one(kwargs: dict[str, Any]) -> ProgramState:
            state = ProgramState(endpoint)
            try:
                self.fn(state, **kwargs)
            finally:
                state._finish()
            state._last.exception()  # wait without raising
            return state

        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            return list(pool.map(one, batch))

    def __call__(self, s: ProgramState, *args: Any, **kwargs: Any) -> Any:
        """Called from another program: writes into that program's state."""
        return self.fn(s, *args, **kwargs)


def function(fn: Callable[..., Any]) -> Program:
    """Makes ``fn(s, ...)`` a program: ``fn.run(...)``, ``fn.run_batch([...])``."""
    return Program(fn)
