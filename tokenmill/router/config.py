"""The router's configuration: workers, policy, health and failover, cache-aware thresholds,
prefill/decode disaggregation."""

from __future__ import annotations

from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_load", "cache_aware", "prefix_hash")
# What a worker does: anything (a plain router), or one half of a disaggregated request
ROLES = ("regular", "prefill", "decode")


@dataclass(frozen=True)
class RouterConfig:
    workers: tuple[str, ...] = ()  # base URLs, e.g. http://127.0.0.1:8001
    policy: str = "cache_aware"
    host: str = "127.0.0.1"
    port: int = 8000
    # Keys a client must present (Authorization: Bearer); empty: no check at the router.
    api_keys: tuple[str, ...] = ()
    # Sent to every worker as its bearer token; None: the client's own header is forwarded.
    worker_api_key: str | None = None
    # Health and failover
    health_check_interval_s: float = 5.0
    health_check_timeout_s: float = 2.0
    eject_after_failures: int = 3  # consecutive failures (checks or requests) that eject
    eject_cooldown_s: float = 10.0  # an ejected worker is probed again after this
    max_retries: int = 2  # further workers tried for a request that has not started streaming
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None  # whole response; None: no limit (long generations)
    retry_after_s: int = 1  # Retry-After of the router's own 503s
    # cache_aware (approximate tree over the routed text, or exact from KV events)
    cache_threshold: float = 0.5  # follow the tree when this share of the prompt matched
    balance_abs_threshold: int = 32  # load imbalanced when max - min in-flight exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max > min * this
    max_tree_chars: int = 1 << 24  # per worker; least recently used leaves go first
    kv_events: bool = True  # mirror workers' KV events when they publish them (exact mode)
    # url -> ZMQ endpoint; a tokenmill worker's is found in its /server_info otherwise
    kv_event_endpoints: tuple[tuple[str, str], ...] = ()
    # prefix_hash
    prefix_hash_tokens: int = 64  # tokens hashed (4 characters a token when only text is known)
    virtual_nodes: int = 160  # points per worker on the hash ring
    # multi-model: a YAML file of model name -> how to start its tokenmill worker
    models_file: str | None = None
    max_running_models: int = 2
    log_level: str = "info"
    # PD mode: each completion goes to a prefill worker (``policy``) with max_tokens=1, then to
    # a decode worker (``decode_policy``) with the KV hand-off it returned (router/pd.py)
    pd: bool = False
    prefill_workers: tuple[str, ...] = ()
    decode_workers: tuple[str, ...] = ()
    decode_policy: str = "least_load"
    # PD mode: a prompt shorter than this (tokens; 4 characters a token when only text is
    # known) goes straight to a decode worker, which computes it: a hand-over costs more than
    # a short prefill, and short prompts are what queues behind long ones on a prefill worker
    pd_min_prompt_tokens: int = 0
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.pd_min_prompt_tokens < 0:
            raise ValueError("pd_min_prompt_tokens must be >= 0")
        if not self.pd:
            if self.prefill_workers or self.decode_workers:
                raise ValueError("prefill and decode workers need PD mode (--pd)")
            return
        if not self.prefill_workers or not self.decode_workers:
            raise ValueError("PD mode needs at least one prefill and one decode worker "
                             "(--prefill URL --decode URL)")
        if self.workers or self.models_file:
            raise ValueError("in PD mode every worker is a prefill or a decode one: give "
                             "--prefill and --decode, not --worker or --models")
        both = set(self.prefill_workers) & set(self.decode_workers)
        if both:
            raise ValueError(f"a worker cannot be both prefill and decode: {sorted(both)}")
        if self.decode_policy not in POLICIES:
            raise ValueError(f"unknown decode policy {self.decode_policy!r}; choose one of "
                             f"{', '.join(POLICIES)}")
