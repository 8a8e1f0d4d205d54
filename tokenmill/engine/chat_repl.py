"""``tokenmill chat``: an interactive terminal chat that streams the reply as it is generated.

Ctrl-D (or ``/exit``) at the prompt ends the session; Ctrl-C while a reply streams stops that
reply (its request is aborted, the conversation keeps what was shown); Ctrl-C at the prompt ends
the session. ``/reset`` starts a new conversation, ``/history`` shows it.
"""

from __future__ import annotations

import itertools
import signal
import sys
import threading
from typing import TextIO

from tokenmill.params import SamplingParams


class ChatSession:
    def __init__(self, llm, params: SamplingParams, system: str | None = None,
                 out: TextIO = sys.stdout):
        self.llm = llm
        self.engine = llm.engine
        self.params = params
        self.system = system
        self.out = out
        self.messages: list[dict[str, str]] = self._fresh()
        self._ids = itertools.count()

    def _fresh(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def run(self) -> int:
        self._say("tokenmill chat: type a message; /history, /reset, Ctrl-D exits.\n")
        while True:
            try:
                line = input(">>> ")
            except (EOFError, KeyboardInterrupt):
                self._say("\n")
                return 0
            text = line.strip()
            if text in ("/exit", "/quit"):
                return 0
            if text == "/history":
                for m in self.messages:
                    self._say(f"[{m['role']}] {m['content']}\n")
                continue
            if text == "/reset":
                self.messages = self._fresh()
                self._say("(conversation cleared)\n")
                continue
            if text:
                self._turn(text)

    def _turn(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        reply = self._stream_reply()
        self.messages.append({"role": "assistant", "content": reply})

    def _stream_reply(self) -> str:
        """Stream one reply. Ctrl-C sets a flag that is read between engine steps: raised as
        KeyboardInterrupt it could land inside a step (leaving the scheduler half-updated) or
        in a finalizer, where Python drops it and the reply runs on."""
        rid = f"chat-{next(self._ids)}"
        shown = ""
        interrupted = threading.Event()
        previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
        try:
            self.engine.add_request(rid, self.llm.chat_prompt_ids(self.messages), self.params)
            while self.engine.has_unfinished_requests() and not interrupted.is_set():
                for out in self.engine.step():
                    text = out.outputs[0].text
                    self._say(text[len(shown):])
                    shown = text
        finally:
            signal.signal(signal.SIGINT, previous)
        if interrupted.is_set():
            self.engine.abort_request(rid)  # a no-op if it is already done
            self._say(" [stopped]")
        self._say("\n")
        return shown

    def _say(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
