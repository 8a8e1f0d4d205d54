"""``tokenmill serve``'s flags for tracing, the request log and dumps (``observe.py``), and the
settings they make. No server imports: the CLI builds its parser, and ``serve`` starts the
engine core, before it imports the server."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.server.tracing import check_tracing


@dataclass(frozen=True)
class ObserveSettings:
    """What ``serve`` records about requests; all off by default."""

    otlp_traces_endpoint: str | None = None  # OTLP collector for request spans
    request_log: str | None = None  # directory of the request log
    request_log_max_bytes: int = 100 * 2**20  # one file's size before it rotates
    request_log_keep: int = 5  # rotated files kept
    request_log_prompts: bool = False  # prompts and messages in the log (else token counts)
    dump_dir: str | None = None  # crash / watchdog dumps (default: the request log's)
    dump_window: float = 300.0  # seconds of finished requests a dump holds
    span_exporter: Any = None  # tests: an SDK SpanExporter instead of an OTLP endpoint

    @property
    def tracing(self) -> bool:
        return self.otlp_traces_endpoint is not None or self.span_exporter is not None

    @property
    def dumps_to(self) -> str | None:
        return self.dump_dir or self.request_log

    @property
    def enabled(self) -> bool:
        return self.tracing or self.request_log is not None or self.dump_dir is not None


_SIZE = re.compile(r"\s*(\d+)\s*([kmg]?)(i?b?)\s*", re.IGNORECASE)


def byte_size(text: str) -> int:
    """``"64MiB"``, ``"100MB"``, ``"1048576"`` -> bytes."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: use bytes, e.g. 64MiB")
    power = "kmg".find(m.group(2).lower()) + 1 if m.group(2) else 0
    base = 1024 if m.group(3).lower().startswith("i") else 1000
    return int(m.group(1)) * base ** power


def add_observe_args(p: argparse.ArgumentParser) -> None:
    d = ObserveSettings()
    g = p.add_argument_group("tracing, request log and dumps (docs/observability.md)")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export a span per request (queue, prefill, decode; token counts) to "
                        "this OpenTelemetry collector: OTLP/HTTP for a URL ending in "
                        "/v1/traces, else gRPC (needs pip install 'tokenmill[tracing]')")
    g.add_argument("--request-log", default=None, metavar="DIR",
                   help="write each generation request (body, timings, outcome) as a JSON "
                        "line under DIR; tokenmill bench replay DIR sends them again")
    g.add_argument("--request-log-max-bytes", type=byte_size, default=d.request_log_max_bytes,
                   help="rotate the request log past this size (default: 100MiB)")
    g.add_argument("--request-log-keep", type=int, default=d.request_log_keep,
                   help=f"rotated request log files kept (default: {d.request_log_keep})")
    g.add_argument("--request-log-prompts", action="store_true",
                   help="log prompts and messages too (default: their token counts only)")
    g.add_argument("--dump-dir", default=None, metavar="DIR",
                   help="where a crash or watchdog trip writes the engine's state and the "
                        "last requests (default: the --request-log directory)")
    g.add_argument("--dump-window", type=float, default=d.dump_window,
                   help=f"seconds of finished requests a dump holds (default: "
                        f"{d.dump_window:g})")


def observe_settings(args: argparse.Namespace) -> ObserveSettings:
    if args.otlp_traces_endpoint:
        check_tracing()  # before the model loads
    return ObserveSettings(
        otlp_traces_endpoint=args.otlp_traces_endpoint, request_log=args.request_log,
        request_log_max_bytes=args.request_log_max_bytes,
        request_log_keep=args.request_log_keep, request_log_prompts=args.request_log_prompts,
        dump_dir=args.dump_dir, dump_window=args.dump_window)
