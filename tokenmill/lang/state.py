"""A running program's state: its text, chat messages and variables, and the worker that sends
its calls.

``s += expr`` queues ``expr`` on the state's own worker thread and returns at once; reading
``s["name"]`` (or ``text()``, ``fork``, ``join``) waits for what was queued before it. So the
calls of one state run in order, and the states of ``fork`` branches (and of ``run_batch``
programs) run side by side, their requests batched together by the server.

Text without a role is a raw prompt and goes to ``/v1/completions``; once a role is used the
program is a chat and ``gen`` inside ``assistant(...)`` goes to ``/v1/chat/completions``
(text already in the assistant turn is continued with ``continue_final_message``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from tokenmill.lang.backend import Endpoint, EndpointError
from tokenmill.lang.ir import Gen, Part, Role, Select, Seq
from tokenmill.lang.selecting import choose


class ProgramError(RuntimeError):
    """A program call failed: the server's refusal (``status``, its message) or a misuse."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Text:
    """What a state has written: ``prompt`` (everything, as plain text), ``messages`` (the
    closed chat turns) and the open turn's role and text."""

    prompt: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None
    turn: str = ""

    def copy(self) -> _Text:
        return _Text(self.prompt, [dict(m) for m in self.messages], self.role, self.turn)

    @property
    def chat(self) -> bool:
        return bool(self.messages) or self.role is not None

    def add(self, piece: str) -> None:
        if self.chat and self.role is None:
            raise ProgramError("text between chat turns: put it inside system(), user() or "
                               "assistant()")
        self.prompt += piece
        if self.role is not None:
            self.turn += piece

    def chat_request(self) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """The messages for a call from the open assistant turn, and the fields that continue
        the turn's text when it has some."""
        if self.role != "assistant":
            raise ProgramError("gen/select in a chat program must be inside assistant()")
        if not self.turn:
            return list(self.messages), {}
        return ([*self.messages, {"role": "assistant", "content": self.turn}],
                {"continue_final_message": True, "add_generation_prompt": False})

    def committable(self) -> list[dict[str, str]]:
        turn = [{"role": self.role, "content": self.turn}] if self.role and self.turn else []
        return [*self.messages, *turn]


class ProgramState:
    """The state a ``@function`` writes to (``s`` in ``def f(s, ...)``)."""

    def __init__(self, endpoint: Endpoint, stream: bool = False,
                 text: _Text | None = None, variables: dict[str, Any] | None = None) -> None:
        self.endpoint = endpoint
        self._text = text or _Text()
        self._vars: dict[str, Any] = dict(variables or {})
        self._meta: dict[str, dict[str, Any]] = {}
        self._stream = stream
        # what has been written, for text_iter: every iterator reads it from the start
        self._events: list[tuple[str | None, str]] = []
        self._ended = False
        self._written = threading.Condition()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-lang")
        self._last: Future | None = None
        self._forks: list[ProgramState] = []  # their streams end with this state's
        self._error: BaseException | None = None

    # ----- writing ------------------------------------------------------------------------

    def __iadd__(self, part: Part) -> ProgramState:
        self._last = self._worker.submit(self._run_guarded, part)
        return self

    @contextmanager
    def role(self, name: str) -> Iterator[None]:
        """``with s.user(): s += ...``: the parts added inside form one message."""
        self += _Open(name)
        yield
        self += _Close(name)

    def system(self) -> Any:
        return self.role("system")

    def user(self) -> Any:
        return self.role("user")

    def assistant(self) -> Any:
        return self.role("assistant")

    # ----- reading (each waits for what was queued before) -------------------------------

    def __getitem__(self, name: str) -> Any:
        self.sync()
        if name not in self._vars:
            raise KeyError(f"no variable {name!r} in this program state "
                           f"(it has {sorted(self._vars)})")
        return self._vars[name]

    def get_var(self, name: str) -> Any:
        return self[name]

    def set_var(self, name: str, value: Any) -> None:
        self.sync()
        self._vars[name] = value

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """How ``name`` was produced: the finish reason of a ``gen``; the method and each
        choice's score of a ``select``."""
        self.sync()
        return self._meta.get(name, {})

    def text(self) -> str:
        self.sync()
        return self._text.prompt

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return self._text.committable()

    def variables(self) -> dict[str, Any]:
        self.sync()
        return dict(self._vars)

    def sync(self) -> None:
        """Waits for every queued part; raises the first failure as ``ProgramError``."""
        last = self._last
        if last is not None:
            last.result()
        if self._error is not None:
            error = self._error
            if isinstance(error, ProgramError):
                raise ProgramError(str(error), error.status) from error
            raise ProgramError(f"{type(error).__name__}: {error}") from error

    # ----- forks --------------------------------------------------------------------------

    def fork(self, n: int) -> ForkGroup:
        """``n`` branches that start from this state's text and variables. The shared text is
        sent once first so the server caches it; the branches' calls then run concurrently."""
        if n < 1:
            raise ValueError(f"fork: n must be >= 1, got {n}")
        self.sync()
        if n > 1:
            self._commit()
        forks = [ProgramState(self.endpoint, self._stream, self._text.copy(), self._vars)
                 for _ in range(n)]
        self._forks.extend(forks)
        return ForkGroup(forks)

    def _commit(self) -> None:
        try:
            if self._text.chat:
                messages = self._text.committable()
                if messages:
                    # an open assistant turn is continued, as the branches' calls will
                    self.endpoint.commit(messages=messages, continue_turn=(
                        self._text.role == "assistant" and bool(self._text.turn)))
            else:
                self.endpoint.commit(prompt=self._text.prompt)
        except EndpointError:
            pass  # a cache warm-up only: the branches' own calls will say what is wrong

    # ----- streaming ----------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is written (``run(stream=True)``): every piece, or only the pieces of
        the ``gen`` named ``var_name``. Ends when the program has finished; each call reads
        from the start."""
        i = 0
        while True:
            with self._written:
                self._written.wait_for(lambda: i < len(self._events) or self._ended)
                events, ended = self._events[i:], self._ended
            i += len(events)
            yield from (piece for name, piece in events if var_name in (None, name))
            if ended and not events:
                self.sync()
                return

    def _finish(self) -> None:
        """The program's body has returned: streams end once what it queued has run."""
        for fork in self._forks:
            fork._finish()
        self._last = self._worker.submit(self._end_stream)

    def _end_stream(self) -> None:
        with self._written:
            self._ended = True
            self._written.notify_all()

    def close(self) -> None:
        self._worker.shutdown(wait=False)

    # ----- running one part (on the worker thread) ----------------------------------------

    def _run_guarded(self, part: Part) -> None:
        if self._error is not None:
            return  # an earlier part failed: the rest of the program does not run
        try:
            self._run(part)
        except BaseException as e:  # noqa: BLE001 - kept for sync() to raise on the caller
            self._error = e

    def _run(self, part: Part) -> None:
        if isinstance(part, str):
            self._write(part, None)
        elif isinstance(part, ProgramState):
            raise ProgramError("a program state cannot be added to another; add its "
                               "variables or text() instead")
        elif isinstance(part, Seq):
            for p in part.parts:
                self._run(p)
        elif isinstance(part, (list, tuple)):
            for p in part:
                self._run(p)
        elif isinstance(part, Role):
            self._run_role(part)
        elif isinstance(part, (_Open, _Close)):
            part.apply(self._text)
        elif isinstance(part, Gen):
            self._run_gen(part)
        elif isinstance(part, Select):
            self._run_select(part)
        else:
            raise ProgramError(f"cannot add {type(part).__name__} to a program state")

    def _run_role(self, role: Role) -> None:
        _Open(role.role).apply(self._text)
        self._run(role.content)
        _Close(role.role).apply(self._text)

    def _write(self, piece: str, name: str | None) -> None:
        self._text.add(piece)
        if self._stream:
            with self._written:
                self._events.append((name, piece))
                self._written.notify_all()

    def _run_gen(self, g: Gen) -> None:
        path, body = self._request(g.body())
        if self._stream:
            text, finish = self._call(lambda: self._streamed(path, body, g.name)), None
        else:
            result = self._call(lambda: self._once(path, body))
            text, finish = result["text"], result["finish_reason"]
            self._write(text, g.name)
        if g.name is not None:
            self._vars[g.name] = text
            self._meta[g.name] = {"finish_reason": finish}

    def _run_select(self, sel: Select) -> None:
        context = None if self._text.chat else self._text.prompt
        picked, meta = self._call(lambda: choose(
            self.endpoint, sel, context, lambda fields: self._once(*self._request(fields))))
        self._write(picked, sel.name)
        if sel.name is not None:
            self._vars[sel.name] = picked
            self._meta[sel.name] = meta

    def _request(self, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The endpoint path and body of a call from the text so far."""
        if not self._text.chat:
            return "/v1/completions", {"prompt": self._text.prompt, **fields}
        messages, extra = self._text.chat_request()
        return "/v1/chat/completions", {"messages": messages, **extra, **fields}

    def _streamed(self, path: str, body: dict[str, Any], name: str | None) -> str:
        pieces = []
        for piece in self.endpoint.stream(path, body):
            pieces.append(piece)
            self._write(piece, name)
        return "".join(pieces)

    def _once(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path == "/v1/completions":
            return self.endpoint.complete(body.pop("prompt"), body)
        return self.endpoint.chat(body.pop("messages"), body)

    @staticmethod
    def _call(fn: Any) -> Any:
        try:
            return fn()
        except EndpointError as e:
            raise ProgramError(e.message if e.status else str(e), e.status) from e


@dataclass(frozen=True)
class _Open:
    role: str

    def apply(self, text: _Text) -> None:
        if text.role is not None:
            raise ProgramError(f"{self.role}() inside {text.role}(): chat turns do not nest")
        if not text.chat and text.prompt:
            raise ProgramError("a chat turn after raw text: a program is either a prompt "
                               "or a chat")
        text.role, text.turn = self.role, ""


@dataclass(frozen=True)
class _Close:
    role: str

    def apply(self, text: _Text) -> None:
        if text.role != self.role:
            raise ProgramError(f"end of {self.role}() without its start")
        text.messages.append({"role": self.role, "content": text.turn})
        text.role, text.turn = None, ""


class ForkGroup(Sequence[ProgramState]):
    """The branches of ``fork``: index them, iterate, ``join()`` to wait for all."""

    def __init__(self, states: list[ProgramState]) -> None:
        self._states = states

    def __getitem__(self, i: Any) -> Any:
        return self._states[i]

    def __len__(self) -> int:
        return len(self._states)

    def __iadd__(self, part: Part | Sequence[Part]) -> ForkGroup:
        """``forks += "text"`` adds to every branch; a list adds its i-th part to branch i."""
        parts = part if isinstance(part, list) else [part] * len(self)
        if len(parts) != len(self):
            raise ValueError(f"{len(parts)} parts for {len(self)} branches")
        for state, p in zip(self._states, parts):
            state += p
        return self

    def join(self) -> list[ProgramState]:
        """Waits for every branch; the first failure raises."""
        for state in self._states:
            state.sync()
        return list(self._states)
