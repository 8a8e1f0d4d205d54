"""``tokenmill router``: its flags, the ``RouterConfig`` they make, and the command.

Importing this module is cheap (argparse only): ``tokenmill --help`` builds every subcommand's
parser, and the server libraries load only when the router runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
from typing import Any

from tokenmill.router.config import POLICIES, RouterConfig

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RouterConfig)}

# (flag, RouterConfig field, argparse keywords) of the settings users tune; the default shown
# is the dataclass's own, and a flag left out is not passed on.
_FLAGS: list[tuple[str, str, dict[str, Any]]] = [
    ("--health-check-interval", "health_check_interval_s",
     dict(type=float, metavar="S", help="seconds between health checks of each worker")),
    ("--health-check-timeout", "health_check_timeout_s",
     dict(type=float, metavar="S", help="a health check not answered in this long failed")),
    ("--eject-after-failures", "eject_after_failures",
     dict(type=int, metavar="N", help="consecutive failures (checks or requests) that eject a "
                                      "worker")),
    ("--eject-cooldown", "eject_cooldown_s",
     dict(type=float, metavar="S", help="an ejected worker is checked again after this long; "
                                        "one good check re-admits it")),
    ("--max-retries", "max_retries",
     dict(type=int, metavar="N", help="other workers tried for a request that failed before "
                                      "its first byte reached the client")),
    ("--connect-timeout", "connect_timeout_s",
     dict(type=float, metavar="S", help="seconds to connect to a worker")),
    ("--request-timeout", "request_timeout_s",
     dict(type=float, metavar="S", help="seconds a worker may stay silent while answering "
                                        "(unset: no limit)")),
    ("--retry-after", "retry_after_s",
     dict(type=int, metavar="S", help="Retry-After of the router's own 503s")),
    ("--cache-threshold", "cache_threshold",
     dict(type=float, help="cache_aware: follow the cache when this share of the prompt "
                           "matched a worker")),
    ("--balance-abs-threshold", "balance_abs_threshold",
     dict(type=int, help="cache_aware: load is imbalanced when the most and least loaded "
                         "workers differ by more than this many requests ...")),
    ("--balance-rel-threshold", "balance_rel_threshold",
     dict(type=float, help="... and the most loaded has more than this times the least")),
    ("--max-tree-chars", "max_tree_chars",
     dict(type=int, help="cache_aware: characters kept per worker in the approximate tree")),
    ("--prefix-hash-tokens", "prefix_hash_tokens",
     dict(type=int, help="prefix_hash: leading tokens hashed")),
    ("--virtual-nodes", "virtual_nodes",
     dict(type=int, help="prefix_hash: points per worker on the hash ring")),
    ("--max-running-models", "max_running_models",
     dict(type=int, metavar="N", help="with --models: models running at once (least recently "
                                      "used idle ones are stopped)")),
    ("--pd-min-prompt-tokens", "pd_min_prompt_tokens",
     dict(type=int, metavar="N", help="with --pd: prompts shorter than this many tokens (4 "
                                      "characters a token when the policy does not tokenize) "
                                      "go straight to a decode worker")),
    ("--log-level", "log_level",
     dict(choices=["critical", "error", "warning", "info", "debug"], help="log level")),
]


def add_router_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``tokenmill router`` on the main parser's subcommands."""
    p = subparsers.add_parser("router", help="one OpenAI-compatible endpoint in front of "
                                             "many workers (cache-aware routing, failover)")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="a worker's base URL, e.g. http://127.0.0.1:8001 (repeatable): "
                        "tokenmill, vLLM, SGLang, llama.cpp or any OpenAI-compatible server")
    p.add_argument("--policy", choices=POLICIES, default=_DEFAULTS["policy"],
                   help=f"how a worker is chosen (default: {_DEFAULTS['policy']})")
    p.add_argument("--host", default=_DEFAULTS["host"])
    p.add_argument("--port", type=int, default=_DEFAULTS["port"])
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require Authorization: Bearer KEY on every route but /health and "
                        "/metrics (repeatable: any of them; default: no check)")
    p.add_argument("--worker-api-key", default=None, metavar="KEY",
                   help="send this key to the workers (default: the client's Authorization "
                        "header is forwarded)")
    p.add_argument("--models", default=None, metavar="FILE", dest="models_file",
                   help="a YAML file of models the router starts as tokenmill workers on "
                        "demand")
    p.add_argument("--no-kv-events", action="store_true",
                   help="cache_aware: ignore the workers' KV-cache events (approximate mode "
                        "only)")
    p.add_argument("--kv-event-endpoint", action="append", default=[],
                   metavar="URL=ENDPOINT", help="where worker URL publishes KV events, e.g. "
                   "http://h:8001=tcp://h:5557 (default: read from a tokenmill worker's "
                   "/server_info)")
    _add_pd_flags(p)
    for flag, name, kwargs in _FLAGS:
        p.add_argument(flag, dest=name, default=None,
                       **{**kwargs, "help": f"{kwargs['help']} (default: {_DEFAULTS[name]})"})
    p.set_defaults(func=cmd_router)
    return p


def _add_pd_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (vLLM's kv_transfer_params "
                             "protocol)")
    g.add_argument("--pd", action="store_true",
                   help="each completion is prefilled on a --prefill worker (max_tokens=1), "
                        "then generated on a --decode worker that pulls the prompt's KV "
                        "blocks from it (workers: tokenmill serve --kv-role producer / "
                        "consumer, or vLLM with a KV connector)")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   dest="prefill_workers",
                   help="a prefill worker's base URL (repeatable; chosen by --policy)")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   dest="decode_workers",
                   help="a decode worker's base URL (repeatable; chosen by --decode-policy)")
    g.add_argument("--decode-policy", choices=POLICIES, default=_DEFAULTS["decode_policy"],
                   help=f"how a decode worker is chosen (default: "
                        f"{_DEFAULTS['decode_policy']})")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if not args.worker and not args.models_file and not args.pd:
        raise ValueError("give at least one --worker URL (or a --models file, or --pd with "
                         "--prefill and --decode URLs)")
    endpoints = []
    for item in args.kv_event_endpoint:
        url, sep, endpoint = item.rpartition("=")
        if not sep or not url or not endpoint:
            raise ValueError(f"--kv-event-endpoint {item!r}: use URL=ENDPOINT")
        endpoints.append((url, endpoint))
    tuned = {name: getattr(args, name) for _, name, _ in _FLAGS
             if getattr(args, name) is not None}
    return RouterConfig(workers=tuple(args.worker), policy=args.policy, host=args.host,
                        port=args.port, api_keys=tuple(args.api_key),
                        worker_api_key=args.worker_api_key, models_file=args.models_file,
                        kv_events=not args.no_kv_events, kv_event_endpoints=tuple(endpoints),
                        pd=args.pd, prefill_workers=tuple(args.prefill_workers),
                        decode_workers=tuple(args.decode_workers),
                        decode_policy=args.decode_policy, **tuned)


def cmd_router(args: argparse.Namespace) -> int:
    """Build the config (and the model launcher, which checks its file) before anything
    starts, so a bad flag or file fails at once."""
    cfg = config_from_args(args)
    launcher = None
    if cfg.models_file:
        from tokenmill.router.models import ModelLauncher

        launcher = ModelLauncher.from_config(cfg)
    from tokenmill.router.app import serve_router

    # uvicorn re-raises the signal that stopped it once it is done; a no-op handler lets a
    # graceful SIGTERM (uvicorn still sees it) end with status 0, as `tokenmill serve` does.
    signal.signal(signal.SIGTERM, lambda *_: None)
    serve_router(cfg, launcher)
    return 0
