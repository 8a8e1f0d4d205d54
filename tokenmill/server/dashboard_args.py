"""``tokenmill serve``'s flags for what the server shows of itself: the metrics' prefix and
whether the dashboard lists prompt text. Stdlib only: the CLI builds its parser without
importing the server."""

from __future__ import annotations

import argparse
import re
from typing import Any

_PREFIX = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _prefix(text: str) -> str:
    if not _PREFIX.fullmatch(text):
        raise argparse.ArgumentTypeError(f"--metrics-prefix {text!r}: a Prometheus name part "
                                         "(letters, digits, _; not starting with a digit)")
    return text


def add_dashboard_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("observability (/metrics, /dashboard)")
    g.add_argument("--metrics-prefix", type=_prefix, default="tokenmill",
                   help="the metrics' names are PREFIX:name; vllm gives vLLM's own names, for "
                        "dashboards and routers written for vLLM (default: tokenmill)")
    g.add_argument("--dashboard-show-prompts", action="store_true",
                   help="/dashboard lists the start of each in-flight request's prompt "
                        "(default: ids, states and token counts only)")


def dashboard_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``ServerSettings`` fields these flags set."""
    return {"metrics_prefix": args.metrics_prefix,
            "dashboard_show_prompts": args.dashboard_show_prompts}
