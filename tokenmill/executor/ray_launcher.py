"""``--distributed-executor-backend ray``: the same ranks (``rank.run_rank``) as Ray actors,
for users who run a Ray cluster already (``ray start --head`` on one node, ``ray start
--address=<head>:6379`` on the others; ``pip install tokenmill[ray]``).

Ray only places the processes: one placement-group bundle of ``threads_per_rank`` CPUs (and a
GPU on CUDA) per rank, packed onto as few nodes as fit. The ranks then meet through the engine's
TCPStore and talk over torch.distributed and the pyzmq control plane exactly as started
processes do, so nothing of a step goes through Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from tokenmill.executor.rank import RankInit, run_rank

logger = logging.getLogger("tokenmill.executor")


class _RankActor:
    """One rank in a Ray worker process (wrapped by ``ray.remote`` at launch)."""

    def run(self, init: RankInit) -> int:
        logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s "
                                                       f"rank{init.rank} %(name)s: %(message)s")
        return run_rank(init)


class RayLauncher:
    def __init__(self, address: str | None = None):
        try:
            import ray
        except ImportError as e:
            raise RuntimeError("--distributed-executor-backend ray needs Ray: "
                               "pip install 'tokenmill[ray]'") from e
        self._ray = ray
        if not ray.is_initialized():
            # an existing cluster (RAY_ADDRESS, or `ray start` on this machine), else a local one
            ray.init(address=address, log_to_driver=True)
        self._actors: dict[int, Any] = {}
        self._runs: dict[int, Any] = {}
        self._group = None

    def host(self) -> str:
        """The address the ranks reach the engine at (this node's, as Ray sees it)."""
        return self._ray.util.get_node_ip_address()

    def launch(self, inits: Sequence[RankInit]) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = inits[0].spec.device.startswith("cuda")
        bundle = {"CPU": inits[0].threads, **({"GPU": 1} if gpu else {})}
        self._group = placement_group([bundle] * len(inits), strategy="PACK")
        ray.get(self._group.ready(), timeout=120)
        actor_cls = ray.remote(_RankActor)
        for i, init in enumerate(inits):
            actor = actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._group, placement_group_bundle_index=i)).remote()
            self._actors[init.rank] = actor
            self._runs[init.rank] = actor.run.remote(init)

    def failure(self) -> str | None:
        ray = self._ray
        done, _ = ray.wait(list(self._runs.values()), num_returns=1, timeout=0)
        if not done:
            return None
        rank = next(r for r, ref in self._runs.items() if ref == done[0])
        try:
            status = ray.get(done[0])
        except Exception as e:  # the actor died (killed, its node lost) or run_rank raised
            return f"rank {rank}'s Ray actor failed: {type(e).__name__}: {e}"
        return f"rank {rank}'s Ray actor ended with status {status}"

    def stop(self, timeout: float) -> None:
        ray = self._ray
        if self._runs:
            ray.wait(list(self._runs.values()), num_returns=len(self._runs), timeout=timeout)
        for actor in self._actors.values():
            ray.kill(actor)
        if self._group is not None:
            ray.util.remove_placement_group(self._group)
        self._actors.clear()
        self._runs.clear()

    def describe(self) -> str:
        return "Ray actors"
