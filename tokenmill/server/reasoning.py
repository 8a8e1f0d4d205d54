"""Split a reasoning model's output into its thinking and its answer, whole or while it streams.

The families here (``--reasoning-parser``: qwen3, deepseek_r1) think inside one tag pair::

    <think>
    the model reasons here
    </think>

    the answer (content; tool calls are parsed from it)

Where the output starts depends on the prompt, so ``start_mode`` reads the rendered prompt's
end: a template that opens the tag itself (DeepSeek-R1, Qwen3 with thinking) leaves the model
inside reasoning; one that writes an empty closed pair (Qwen3 with ``enable_thinking: false``)
leaves it in the answer. Otherwise the family decides: a qwen3 output is the answer unless it
opens with the tag, a deepseek_r1 output is reasoning until ``</think>`` (those models often
leave out the opening tag).

Both ``split`` and the streamer run one state machine, so a streamed answer reassembles to
exactly what ``split`` returns for the whole text:

- reasoning is the text between the (possibly implicit) opening tag and the first closing tag,
  with surrounding whitespace removed; a repeated opening tag at its start is dropped;
- content is everything after the closing tag, leading whitespace removed; an output with no
  reasoning at all is content unchanged;
- an output cut off inside reasoning is all reasoning (its content is None).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

Piece = tuple[str, str]  # ("reasoning" | "content", text)


class Mode(enum.Enum):
    UNDECIDED = "undecided"  # an opening tag may still come
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class StartMode:
    """Where an output starts: ``mode``, and for UNDECIDED what it is without an opening tag."""

    mode: Mode
    default_reasoning: bool = False


class ReasoningParser:
    """One family's thinking tags; subclasses say what an output without a sign from the
    prompt starts in."""

    name: str
    start_tag = "<think>"
    end_tag = "</think>"
    implicit_start: bool = False  # no opening tag needed: the output starts in reasoning

    def start_mode(self, prompt_tail: str = "", continued: bool = False) -> StartMode:
        """Where an output starts, given the end of its rendered prompt; a ``continued``
        message (continue_final_message) goes on where its text stands, never opening a tag."""
        opened, closed = prompt_tail.rfind(self.start_tag), prompt_tail.rfind(self.end_tag)
        if continued:
            return StartMode(Mode.REASONING if opened > closed else Mode.CONTENT)
        if opened > closed:  # the template opened thinking: the model is inside it
            return StartMode(Mode.UNDECIDED, default_reasoning=True)
        if closed != -1 and prompt_tail.rstrip().endswith(self.end_tag):
            return StartMode(Mode.CONTENT)  # thinking switched off with an empty pair
        return StartMode(Mode.UNDECIDED, default_reasoning=self.implicit_start)

    def streamer(self, start: StartMode | None = None) -> ReasoningStreamer:
        return ReasoningStreamer(self, start or self.start_mode())

    def split(self, text: str, start: StartMode | None = None) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; either is None when it has none."""
        s = self.streamer(start)
        pieces = s.feed(text) + s.finish()
        reasoning = "".join(t for kind, t in pieces if kind == "reasoning")
        content = "".join(t for kind, t in pieces if kind == "content")
        if not s.reasoned:
            return None, content
        return reasoning or None, content or None


@dataclass(frozen=True)
class ReasoningSetup:
    """What one request does with reasoning: the parser, where its output starts, and whether
    the reasoning is returned (vLLM's ``include_reasoning``; when not, it is dropped)."""

    parser: ReasoningParser
    start: StartMode
    include: bool = True

    def streamer(self) -> ReasoningStreamer:
        return self.parser.streamer(self.start)

    def split(self, text: str) -> tuple[str | None, str | None]:
        return self.parser.split(text, self.start)


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


class _Stripper:
    """Streams text with ``str.strip`` applied to the whole: leading whitespace dropped,
    trailing whitespace held until more text follows it."""

    def __init__(self, strip_end: bool) -> None:
        self._started = False
        self._pending = ""
        self._strip_end = strip_end

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        if not self._strip_end:
            return text
        combined = self._pending + text
        released = combined.rstrip()
        self._pending = combined[len(released):]
        return released


class ReasoningStreamer:
    """Incremental ``split``: feed text deltas, get (kind, text) pieces back. Text that could
    still be part of a tag is held until it is decided (or ``finish``)."""

    def __init__(self, parser: ReasoningParser, start: StartMode) -> None:
        self._parser = parser
        self._mode = start.mode
        self._default_reasoning = start.default_reasoning
        self._buf = ""
        self._reasoning = _Stripper(strip_end=True)
        self._content: _Stripper | None = None  # after reasoning: leading whitespace dropped
        self.reasoned = start.mode is Mode.REASONING  # the output had reasoning (maybe empty)

    def feed(self, delta: str) -> list[Piece]:
        self._buf += delta
        out: list[Piece] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """Decide whatever is still held: the output ended."""
        out: list[Piece] = []
        if self._mode is Mode.UNDECIDED:
            self._enter(Mode.REASONING if self._default_reasoning else Mode.CONTENT)
        if self._mode is Mode.REASONING:
            self._emit("reasoning", self._buf, out)
        else:
            self._emit("content", self._buf, out)
        self._buf = ""
        return out

    def _step(self, out: list[Piece]) -> bool:
        """Consume what can be decided in the buffer; True if the mode changed."""
        p = self._parser
        if self._mode is Mode.UNDECIDED:
            head = self._buf.lstrip()
            if head.startswith(p.start_tag):
                self._buf = head[len(p.start_tag):]
                self._enter(Mode.REASONING)
                return True
            if not head or p.start_tag.startswith(head):
                return False  # only whitespace, or what may still become the tag
            self._enter(Mode.REASONING if self._default_reasoning else Mode.CONTENT)
            return True
        if self._mode is Mode.REASONING:
            end = self._buf.find(p.end_tag)
            if end == -1:
                keep = _tag_prefix_len(self._buf, p.end_tag)
                self._emit("reasoning", self._buf[:len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep:]
                return False
            self._emit("reasoning", self._buf[:end], out)
            self._buf = self._buf[end + len(p.end_tag):]
            self._content = _Stripper(strip_end=False)
            self._mode = Mode.CONTENT
            return True
        self._emit("content", self._buf, out)
        self._buf = ""
        return False

    def _enter(self, mode: Mode) -> None:
        self._mode = mode
        self.reasoned = self.reasoned or mode is Mode.REASONING

    def _emit(self, kind: str, text: str, out: list[Piece]) -> None:
        if kind == "reasoning":
            text = self._reasoning.push(text)
        elif self._content is not None:
            text = self._content.push(text)
        if text:
            out.append((kind, text))


def _tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A parser by its registry name; ValueError listing the known names if there is none."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None
