"""The all-reduce's cost per call between tensor-parallel ranks on one host: the kernels'
shared-memory ShmAllReduce (tokenmill/distributed/shm.py) against torch.distributed's gloo
all_reduce, for the hidden states a decoder layer sums (rows x 576, the default model's hidden
size), in float32 and bf16:

    python benchmarks/allreduce.py [--ranks 2] [--rows 1,32,512] [--min-time 0.3]

Each rank runs one intra-op thread. Prints the CPU, then a table of microseconds per call (as
rank 0 timed them), and one JSON object per row of it.
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 576
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def timed(fn: Callable[[], object], min_time: float) -> float:
    """Microseconds per call of ``fn`` on this rank; every rank makes the same calls (a
    collective pairs them), as many as fill ``min_time`` on rank 0."""
    for _ in range(20):  # warm-up
        fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        fn()
    per_call = (time.perf_counter() - start) / 20
    count = torch.tensor([max(20, int(min_time / max(per_call, 1e-7)))])
    dist.broadcast(count, 0)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(int(count.item())):
        fn()
    return (time.perf_counter() - start) / int(count.item()) * 1e6


def _rank(rank: int, world: int, port: int, rows_list: list[int], min_time: float) -> None:
    from tokenmill.distributed.shm import ShmAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    shm = ShmAllReduce.create(f"bench-{port}", rank, world, 1 << 20, dist.barrier)
    results = []
    for name, dtype in DTYPES.items():
        for rows in rows_list:
            t = torch.randn(rows, HIDDEN).to(dtype)
            row = {"dtype": name, "rows": rows, "bytes": t.numel() * t.element_size(),
                   "gloo_us": round(timed(lambda: dist.all_reduce(t), min_time), 1)}
            if shm is not None:
                row["ShmAllReduce_us"] = round(timed(lambda: shm.all_reduce_(t), min_time), 1)
            results.append(row)
    if rank == 0:
        report(world, results)
    dist.destroy_process_group()


def report(world: int, results: list[dict]) -> None:
    from tokenmill.platform import cpu_description

    cpu = cpu_description()
    print(f"# {cpu['cpu']}; {world} ranks, 1 thread each")
    print(f"{'dtype':8} {'rows':>5} {'bytes':>9} {'gloo us':>9} {'shm us':>9} {'x':>6}")
    for r in results:
        shm = r.get("ShmAllReduce_us")
        ratio = f"{r['gloo_us'] / shm:.1f}" if shm else "-"
        print(f"{r['dtype']:8} {r['rows']:>5} {r['bytes']:>9} {r['gloo_us']:>9} "
              f"{shm if shm else '-':>9} {ratio:>6}")
    for r in results:
        print(json.dumps({**r, "ranks": world, "cpu": cpu}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rows", default="1,32,512")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds per timing")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = [int(r) for r in args.rows.split(",")]
    mp.spawn(_rank, args=(args.ranks, port, rows, args.min_time), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
