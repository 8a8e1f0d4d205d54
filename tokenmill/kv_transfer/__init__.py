"""Moving KV blocks: between instances (prefill/decode disaggregation) and to slower tiers
(host memory, disk). ``base.py`` is the connector interface, torch-free, which the scheduler
calls; the rest runs beside the workers' KV caches."""
