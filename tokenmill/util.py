"""Small helpers every layer may use (stdlib only, but for the terminal's progress bar, which
imports tqdm when the CLI draws one)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TypeVar

_T = TypeVar("_T")

# What a long operation calls as it goes: advance(n) when n more of its steps are done.
Advance = Callable[[int], None]
# Shows one operation's progress: (description, total steps or None, what a step is or None
# for an operation without steps) -> a context giving its Advance. The CLI installs one (a
# bar on a terminal); library code never prints by itself.
ProgressDisplay = Callable[[str, "int | None", "str | None"], AbstractContextManager[Advance]]
_display: ProgressDisplay | None = None


def release_free_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing where
    the C library has none). Freed blocks below glibc's mmap threshold stay in the process
    otherwise: after a load that quantized a model, over 100 MB of its float32 temporaries."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def cdiv(a: int, b: int) -> int:
    """Ceil division: how many ``b``-sized pieces hold ``a`` (blocks for tokens, words for bits)."""
    return -(-a // b)


def set_progress_display(display: ProgressDisplay | None) -> None:
    """Where ``progress`` reports from now on (None: nowhere, the default)."""
    global _display
    _display = display


@contextmanager
def progress(description: str, total: int | None = None,
             unit: str | None = None) -> Iterator[Advance]:
    """``with progress("loading weights", n, "tensor") as advance: ... advance(1)``: a long
    operation's progress (no ``unit``: its time only), shown only where the CLI installed a
    display (a terminal, or when asked)."""
    if _display is None:
        yield _ignore
        return
    with _display(description, total, unit) as advance:
        yield advance


def tracked(items: Iterable[_T], description: str, total: int | None = None,
            unit: str = "it") -> Iterator[_T]:
    """``items`` unchanged, each one counted by ``progress`` as the loop takes the next."""
    with progress(description, total, unit) as advance:
        for item in items:
            yield item
            advance(1)


@contextmanager
def terminal_progress(description: str, total: int | None,
                      unit: str | None) -> Iterator[Advance]:
    """A ``ProgressDisplay``: a tqdm bar on stderr, redrawn twice a second so that an operation
    with no steps to count (a compiler run) still shows its time going by; gone when it ends."""
    import sys
    import threading

    from tqdm import tqdm

    shape = None if total is not None else \
        "{desc}: {n_fmt} {unit} [{elapsed}]" if unit else "{desc} [{elapsed}]"
    with tqdm(total=total, desc=description, leave=False, file=sys.stderr, unit=unit or "it",
              bar_format=shape) as bar:
        done = threading.Event()

        def tick() -> None:
            while not done.wait(0.5):
                bar.refresh()

        ticker = threading.Thread(target=tick, name="tokenmill-progress", daemon=True)
        ticker.start()
        try:
            yield bar.update
        finally:
            done.set()
            ticker.join()


def _ignore(n: int = 1) -> None:
    """The Advance of an operation nobody watches."""
