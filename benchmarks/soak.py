"""Soak test: many streaming clients for minutes, some of them walking away; no request may fail,
the server must be idle again with every KV block back, and its memory must stop growing.

    python3 benchmarks/soak.py [--model NAME] [--clients 256] [--duration 300] [--rounds 1]
        [--max-prompt 256] [--sample-every 15] [--warmup 180] [--max-growth 512]
        [--onednn-cache N] [--url http://127.0.0.1:8000 [--pid PID]]
        [--out FILE] [--debug-dumps [--tracemalloc FRAMES]]
        [any other flag: passed to ``tokenmill serve``, e.g. --max-num-seqs 32]

Without ``--url`` it starts ``tokenmill serve`` as ``benchmarks/compare.py`` does
(``peers.TokenmillPeer``: 2 GiB of KV cache, 2,048-token context), serving ``--model`` (default
``smollm2-135m-instruct``), with the extra flags appended. With ``--url`` it loads a running
server; give ``--pid`` (or have psutil find who listens on the port) to sample its memory.

Each of ``--clients`` clients loops until ``--duration`` s are over: completions or chat (half
each), a random prompt (8 to ``--max-prompt`` tokens of random text, default 256; a third are
one of four shared 256-token prefixes + 8 to 64 tokens, so the prefix cache hits, locks and
evicts), 16 to 128 output tokens, temperature 0 or 0.8. Most requests stream to the end;
``--disconnect`` of them (20 %) drop the connection after 1 to 4 chunks, ``--timeout`` (10 %)
have a client deadline of 0.2 to 2 s for the whole request, ``--cancel`` (10 %) are
non-streaming requests cancelled after 0.1 to 3 s. Outcomes are counted: completed,
disconnected, timed out, cancelled, errors by HTTP status or exception. ``--rounds R`` repeats
the load R times with an idle pause between (does memory keep growing round after round?).

Every ``--sample-every`` s (default 15; and before the load, when it stops and once the server
is idle) the resident memory of the server process and its children (psutil, else /proc VmRSS)
is recorded with the running / waiting / KV-usage gauges of ``/metrics`` and its block counts
(``kv_cache_blocks``, ``kv_cache_free_blocks``, ``prefix_cache_blocks``, where the server has
them). After the load the script waits until the server is idle.

The verdict (``tokenmill.bench.verdicts.soak_verdict``) fails the run on any of:

- a failed request: an HTTP error status, an error event in a stream, a stream that ended
  without ``[DONE]``, a refused or reset connection (requests the clients themselves walk away
  from, and those still running when the load stops, are not failures);
- a server that is not idle once the load is over (running, waiting or KV usage above 0 after
  ``--idle-timeout`` s) or does not answer;
- leaked KV blocks: fewer blocks free once idle than before the load. Cached prefix blocks
  nobody holds are evictable and count as free (``KVBlockManager.usage``), so a warm prefix
  cache is no leak; a server that does not report the counts fails (nothing was checked);
- memory growth: private resident memory under load after ``--warmup`` s (default 180)
  growing faster than ``--max-growth`` MiB per hour (default 512), measured as the Theil-Sen
  slope (median of pairwise slopes) of the samples, so one sample caught in a burst does not
  decide it; fewer than two samples after the warm-up fail too. Private is RSS less shared
  pages (``RssShmem``): the KV cache is a shared anonymous mapping whose pages become
  resident as blocks first hold tokens, so RSS climbs towards the whole KV budget (2 GiB
  here) for minutes without any leak. A 5-minute run resolves a few hundred MiB per hour
  (samples after the warm-up move by a few MiB); a leak of a few KiB per request shows only
  in a longer run (``--duration``).

Private memory rises for a while without any leak, which is what the warm-up is for: oneDNN's
matmul keeps two per-shape caches (ideep's, ``LRU_CACHE_CAPACITY``, and its primitive cache,
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), about 0.3 MiB per entry, and every new number of tokens in
a step that goes through oneDNN is a new shape (on a CPU without AMX every bf16 step of more than
a few rows; with AMX the steps from the rows the load-time trial chose, ``cpu_step`` in
``/server_info``). At the library's 1,024 entries each they took longer to fill than a 5-minute
soak lasts (+590 MiB after 4 minutes of 64 clients on a 2-core Xeon with AMX, still rising), so
``tokenmill serve`` caps both at 256 entries unless its environment sets them (full within
about 2.5 minutes there, then flat). The soak runs the server as users get it;
``--onednn-cache N`` sets both to N in the server it starts (0: as ``tokenmill serve``
chooses). Other environment variables, such as MALLOC_ARENA_MAX, reach the server as
set for this script.

``--debug-dumps`` (only when this script starts the server) runs the server through a wrapper
that, on SIGUSR1, writes a dump next to the results: RSS breakdown, glibc ``mallinfo2`` and
arena count, Python objects by type, sizes of the containers of tokenmill's singletons and
their lru_caches, and a tracemalloc snapshot when the server runs with PYTHONTRACEMALLOC set
(``--tracemalloc N`` sets it, N frames); the last idle point also calls ``malloc_trim(0)`` and
records what it gave back. Dumps are taken before the load and at every idle point; the
summary compares the first idle dump after load with the last.

Writes ``--out`` (default ``benchmarks/results/soak.json``: machine, config, counts, memory
series, final gauges, verdict) and prints a table. Exit status 1 when the verdict is not clean.
Not part of the test suite (its verdict is: ``tests/test_verdicts.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "peers"))

from peers import (SERVED_NAME, Launch, TokenmillPeer, start_peer,  # noqa: E402
                   stop_on_sigterm)  # (benchmarks/peers/peers.py)

from tokenmill.bench.verdicts import SoakLimits, soak_verdict  # noqa: E402

MIB = 1024 * 1024
ONEDNN_CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")  # ideep's, oneDNN's
DEFAULT_MODEL = "smollm2-135m-instruct"
GAUGES = {"running": "tokenmill:num_requests_running", "waiting": "tokenmill:num_requests_waiting",
          "kv_cache_usage": "tokenmill:kv_cache_usage_perc",
          # block counts (servers from a05c0c2 on; None before)
          "blocks": "tokenmill:kv_cache_blocks", "free_blocks": "tokenmill:kv_cache_free_blocks",
          "prefix_cached_blocks": "tokenmill:prefix_cache_blocks"}


# ----- the server wrapper for --debug-dumps (runs in the server process) -----------------------

def _proc_status(pid: int | str = "self") -> dict[str, int]:
    """The kB fields of /proc/PID/status that describe memory, in bytes; Threads as a count."""
    out = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem", "VmData"):
            out[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            out[key] = int(value)
    return out


def _mallinfo() -> dict[str, int]:
    """glibc's malloc statistics over all arenas, and the number of arenas (malloc_info)."""
    import ctypes

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = Mallinfo2
    except (OSError, AttributeError):
        return {}
    m = libc.mallinfo2()
    info = {name: getattr(m, name) for name, _ in Mallinfo2._fields_}
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as f:
        libc.fopen.restype = ctypes.c_void_p
        libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
        libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        fp = libc.fopen(f.name.encode(), b"w")
        if fp:
            libc.malloc_info(0, fp)
            libc.fclose(fp)
            info["num_arenas"] = f.read().count("<heap nr=")
    return info


def _singleton_containers() -> tuple[dict, dict, dict]:
    """Objects by type name (top 40), the lengths of the container attributes of tokenmill
    objects that exist at most 3 times (engine, scheduler, caches, ...), and tokenmill's
    lru_caches."""
    import functools
    import gc

    objects = gc.get_objects()
    by_type = collections.Counter(type(o).__qualname__ for o in objects)
    instances: dict[type, list] = collections.defaultdict(list)
    lru = {}
    def module(x) -> str:
        m = getattr(x, "__module__", "")
        return m if isinstance(m, str) else ""

    for o in objects:
        t = type(o)
        if module(t).startswith("tokenmill"):
            instances[t].append(o)
        elif isinstance(o, functools._lru_cache_wrapper):
            owner = getattr(o, "__wrapped__", None)
            if module(owner).startswith("tokenmill"):
                name = getattr(owner, "__qualname__", repr(owner))
                lru[f"{module(owner)}.{name}"] = o.cache_info()._asdict()
    sizes = {}
    for t, objs in instances.items():
        if len(objs) > 3:
            continue
        for i, o in enumerate(objs):
            attrs = getattr(o, "__dict__", None) or {}
            lens = {k: len(v) for k, v in attrs.items()
                    if isinstance(v, (dict, list, set, collections.deque))}
            if lens:
                sizes[f"{module(t)}.{t.__qualname__}#{i}"] = lens
    return dict(by_type.most_common(40)) | {"_total": len(objects)}, sizes, lru


def _dump_server_state(directory: Path, trim: bool) -> None:
    import tracemalloc

    index = len(list(directory.glob("dump-*.json")))
    out = {"time": time.time(), "status": _proc_status(), "malloc": _mallinfo()}
    out["objects"], out["containers"], out["lru_caches"] = _singleton_containers()
    torch = sys.modules.get("torch")
    if torch is not None:
        import gc

        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
        out["tensors"] = {"count": len(tensors), "bytes": sum(
            t.untyped_storage().nbytes() for t in tensors if t.device.type == "cpu")}
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        out["tracemalloc"] = {"current": current, "peak": peak}
        tracemalloc.take_snapshot().dump(str(directory / f"dump-{index:02d}.tracemalloc"))
    if trim:
        import ctypes

        before = _proc_status()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["malloc_trim"] = {"before": before, "after": _proc_status(), "malloc": _mallinfo()}
    (directory / f"dump-{index:02d}.json").write_text(json.dumps(out, indent=1))


def serve_with_dumps(directory: str, argv: list[str]) -> int:
    """``tokenmill serve`` in this process; SIGUSR1 writes a dump, SIGUSR2 a dump + trim."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)

    def handler(signum, _frame):
        try:
            _dump_server_state(path, trim=signum == signal.SIGUSR2)
        except Exception as e:  # a debugging aid must not kill the server
            (path / "dump-error.txt").write_text(repr(e))

    signal.signal(signal.SIGUSR1, handler)
    signal.signal(signal.SIGUSR2, handler)
    sys.path.insert(0, str(HERE.parent))  # as `python -m tokenmill.cli` run from the repository
    from tokenmill.cli import main as cli_main

    return cli_main(argv)


# ----- memory and gauges, seen from outside ----------------------------------------------------

def process_rss(pid: int) -> dict[str, int]:
    """RSS of ``pid`` plus its children (psutil; else /proc, with the processes of its session),
    and the main process's anonymous / file-backed split."""
    status = _proc_status(pid)
    try:
        import psutil

        p = psutil.Process(pid)
        children = p.children(recursive=True)
        total = p.memory_info().rss
        for c in children:
            try:
                total += c.memory_info().rss
            except psutil.Error:
                pass
        n_children = len(children)
    except ImportError:
        from compare import session_processes  # noqa: PLC0415  (benchmarks/compare.py)

        others = [int(e.name) for e, _ in session_processes(pid) if int(e.name) != pid]
        total = status.get("VmRSS", 0) + sum(_proc_status(o).get("VmRSS", 0) for o in others)
        n_children = len(others)
    except Exception:  # the process is gone
        return {}
    return {"rss": total, "children": n_children, "anon": status.get("RssAnon", 0),
            "file": status.get("RssFile", 0), "shmem": status.get("RssShmem", 0),
            "threads": status.get("Threads", 0)}


def find_listener(url: str) -> int | None:
    """The pid listening on the URL's port (psutil), for --url without --pid."""
    from urllib.parse import urlparse

    port = urlparse(url).port
    try:
        import psutil

        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except (ImportError, OSError):
        pass
    return None


def parse_metrics(text: str) -> dict[str, list[tuple[str, float]]]:
    """Prometheus text -> name -> [(labels, value)]."""
    out: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        try:
            out[name].append((labels.rstrip("}"), float(value)))
        except ValueError:
            pass
    return out


def block_counts(gauges: dict, info: dict) -> dict:
    """Usable / free (never used, or cached and evictable) / prefix-cached KV blocks from the
    /metrics gauges, else /server_info; a server without them gives only the total (derived)."""
    if gauges.get("blocks") is not None:
        return {"total": gauges["blocks"], "free": gauges["free_blocks"],
                "prefix_cached": gauges["prefix_cached_blocks"], "source": "/metrics"}
    if isinstance(info.get("kv_cache_blocks"), dict):
        return {**info["kv_cache_blocks"], "source": "/server_info"}
    out = {"source": "not exposed by this server: only the total, derived"}
    if info.get("kv_cache_tokens") and info.get("block_size"):
        out["total"] = info["kv_cache_tokens"] // info["block_size"]
    return out


class SoakPeer(TokenmillPeer):
    """compare.py's tokenmill launch with another model and extra flags, oneDNN's two shape
    caches at ``onednn_cache`` entries (0: as ``tokenmill serve`` chooses) and, for --debug-dumps,
    this file's dump wrapper in place of ``-m tokenmill.cli``."""

    def __init__(self, model: str, flags: list[str], dumps: Path | None, frames: int,
                 onednn_cache: int = 0):
        super().__init__("soak", extra=tuple(flags))
        self.model, self.dumps, self.frames = model, dumps, frames
        self.onednn_cache = onednn_cache

    def launch(self, root: Path, port: int) -> Launch:
        spec = super().launch(root, port)
        argv = [self.model if a == SERVED_NAME else a for a in spec.argv]
        env = dict(spec.env)
        if self.onednn_cache:
            for name in ONEDNN_CACHES:  # read when torch loads: the environment is the way in
                if name not in os.environ:
                    env[name] = str(self.onednn_cache)
        if self.dumps is not None:
            i = argv.index("-m")
            argv[i:i + 2] = [str(Path(__file__).resolve()), "_serve", str(self.dumps)]
            if self.frames:
                env["PYTHONTRACEMALLOC"] = str(self.frames)
        return Launch(argv, env, spec.cwd)


class Server:
    """The server under test: its URL, pid, served model name and what it tells about itself."""

    def __init__(self, url: str, pid: int | None):
        self.url, self.pid = url.rstrip("/"), pid
        self.model = ""
        self.info: dict = {}

    async def metrics(self, http) -> dict:
        r = await http.get(f"{self.url}/metrics", timeout=30)
        r.raise_for_status()
        return parse_metrics(r.text)

    async def gauges(self, http) -> dict[str, float | None]:
        try:
            m = await self.metrics(http)
        except Exception as e:  # noqa: BLE001  (a dead server is a finding, not a crash)
            return {"error": type(e).__name__}
        return {key: (m[name][0][1] if m.get(name) else None) for key, name in GAUGES.items()}

    async def sample(self, http, t0: float, phase: str, series: list) -> dict:
        row = {"t_s": round(time.monotonic() - t0, 1), "phase": phase,
               **await self.gauges(http)}
        if self.pid:
            mem = process_rss(self.pid)
            # The KV cache is a shared anonymous mapping whose pages become resident as blocks
            # first hold tokens (runner/kv_cache.py: ``zeroed``), up to the whole budget: RSS
            # rises for minutes without a leak. "private" is RSS less those shared pages.
            row.update({"rss_mib": round(mem["rss"] / MIB, 1),
                        "private_mib": round((mem["rss"] - mem["shmem"]) / MIB, 1),
                        "anon_mib": round(mem["anon"] / MIB, 1),
                        "file_mib": round(mem["file"] / MIB, 1),
                        "shmem_mib": round(mem["shmem"] / MIB, 1),
                        "children": mem["children"], "threads": mem["threads"]} if mem
                       else {"rss_mib": None, "private_mib": None})
        series.append(row)
        print(fmt_row(row), flush=True)
        return row


# ----- the load ---------------------------------------------------------------------------------

class Prompts:
    """Random text of 8 to ``max_len`` tokens, a third behind one of four shared 256-token
    prefixes (the pool is built once: a prompt is picked, not generated, per request)."""

    def __init__(self, model: str, seed: int, max_len: int, pool: int = 96):
        from tokenmill.bench.workloads import random_text
        from tokenmill.errors import TokenmillError
        from tokenmill.tokenizer import load_tokenizer

        try:
            tok = load_tokenizer(model)
        except TokenmillError:
            tok = load_tokenizer(DEFAULT_MODEL)
        rng = random.Random(seed)
        vocab = tok.vocab_size
        self.prefixes = [random_text(rng, tok, 256, vocab) for _ in range(4)]
        self.texts = [random_text(rng, tok, rng.randint(8, max_len), vocab) for _ in range(pool)]
        self.questions = [random_text(rng, tok, rng.randint(8, 64), vocab) for _ in range(pool)]

    def pick(self, rng: random.Random) -> str:
        if rng.random() < 1 / 3:
            return rng.choice(self.prefixes) + "\n" + rng.choice(self.questions)
        return rng.choice(self.texts)


class Counts:
    def __init__(self):
        self.outcomes: collections.Counter = collections.Counter()
        self.errors: collections.Counter = collections.Counter()
        self.by_endpoint: collections.Counter = collections.Counter()
        self.chunks = 0

    def error(self, what: str) -> None:
        self.outcomes["error"] += 1
        self.errors[what] += 1

    def as_dict(self) -> dict:
        return {"outcomes": dict(self.outcomes), "errors": dict(self.errors),
                "by_endpoint": dict(self.by_endpoint), "stream_chunks": self.chunks,
                "requests": sum(self.outcomes.values())}


async def one_request(http, server: Server, prompts: Prompts, rng: random.Random,
                      counts: Counts, args) -> None:
    chat = rng.random() < 0.5
    text = prompts.pick(rng)
    body = {"model": server.model, "max_tokens": rng.randint(16, 128),
            "temperature": rng.choice([0.0, 0.8])}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    counts.by_endpoint["chat" if chat else "completions"] += 1
    r = rng.random()
    if r < args.disconnect:
        mode, stop_after = "disconnect", rng.randint(1, 4)
    elif r < args.disconnect + args.timeout:
        mode, stop_after = "timeout", None
    elif r < args.disconnect + args.timeout + args.cancel:
        mode, stop_after = "cancel", None
    else:
        mode, stop_after = "stream", None
    url = server.url + path
    if mode == "cancel":
        task = asyncio.ensure_future(http.post(url, json=body))
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.1, 3.0))
        if not done:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            counts.outcomes["cancelled"] += 1
            return
        try:
            resp = task.result()
        except Exception as e:  # noqa: BLE001
            counts.error(type(e).__name__)
            return
        if resp.status_code == 200:
            counts.outcomes["completed (non-streaming, before its cancel)"] += 1
        else:
            counts.error(f"HTTP {resp.status_code}")
        return
    body["stream"] = True
    try:
        async with asyncio.timeout(rng.uniform(0.2, 2.0) if mode == "timeout" else None):
            async with http.stream("POST", url, json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    counts.error(f"HTTP {resp.status_code}")
                    return
                chunks = 0
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        counts.outcomes["completed"] += 1
                        return
                    if '"error"' in line[:16]:
                        counts.error("error event in the stream")
                        return
                    chunks += 1
                    counts.chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        counts.outcomes["disconnected"] += 1
                        return  # leaving the block closes the connection mid-stream
                counts.error("stream ended without [DONE]")
    except TimeoutError:
        counts.outcomes["timed out"] += 1
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001  (counted; the soak goes on)
        counts.error(type(e).__name__)


async def client(http, server, prompts, seed, counts, deadline, args) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        await one_request(http, server, prompts, rng, counts, args)


async def wait_idle(http, server: Server, timeout: float) -> tuple[dict, float]:
    """Poll /metrics until nothing runs, waits or holds KV blocks; (gauges, seconds waited)."""
    start = time.monotonic()
    while True:
        g = await server.gauges(http)
        if g.get("running") == 0 and g.get("waiting") == 0 and g.get("kv_cache_usage") == 0:
            return g, time.monotonic() - start
        if "error" in g or time.monotonic() - start > timeout:
            return g, time.monotonic() - start
        await asyncio.sleep(1)


def dump(server: Server, dumps: Path | None, trim: bool = False) -> None:
    """Ask the wrapper for a dump and wait until it is written."""
    if dumps is None or not server.pid:
        return
    before = len(list(dumps.glob("dump-*.json")))
    os.kill(server.pid, signal.SIGUSR2 if trim else signal.SIGUSR1)
    deadline = time.monotonic() + 120
    while len(list(dumps.glob("dump-*.json"))) == before and time.monotonic() < deadline:
        if (dumps / "dump-error.txt").exists():
            why = (dumps / "dump-error.txt").read_text()
            raise RuntimeError(f"the server's dump failed: {why}")
        time.sleep(0.5)


async def soak(server: Server, args, dumps: Path | None) -> dict:
    import httpx

    prompts = Prompts(server.model, args.seed, args.max_prompt)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    series: list[dict] = []
    counts = Counts()
    rounds = []
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        r = await http.get(f"{server.url}/server_info", timeout=30)
        server.info = r.json() if r.status_code == 200 else {}
        print(fmt_header(), flush=True)
        t0 = time.monotonic()
        await server.sample(http, t0, "start", series)
        await asyncio.to_thread(dump, server, dumps)
        for rnd in range(args.rounds):
            round_counts = Counts()
            deadline = time.monotonic() + args.duration
            seeds = [args.seed * 100_003 + rnd * 10_007 + i for i in range(args.clients)]
            tasks = [asyncio.create_task(client(http, server, prompts, s, round_counts,
                                                deadline, args)) for s in seeds]
            next_sample = time.monotonic() + args.sample_every
            while time.monotonic() < deadline:
                await asyncio.sleep(max(0.0, min(deadline, next_sample) - time.monotonic()))
                if time.monotonic() >= next_sample - 0.01 and time.monotonic() < deadline - 1:
                    await server.sample(http, t0, f"load r{rnd + 1}", series)
                    next_sample += args.sample_every
            await server.sample(http, t0, f"load r{rnd + 1} end", series)
            # clients still in a request are stopped: their connections close mid-request
            in_flight = sum(not t.done() for t in tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            round_counts.outcomes["stopped at the end"] += in_flight
            gauges, waited = await wait_idle(http, server, args.idle_timeout)
            await asyncio.sleep(args.settle)
            await server.sample(http, t0, f"idle r{rnd + 1}", series)
            last = rnd == args.rounds - 1
            await asyncio.to_thread(dump, server, dumps, last and args.trim_at_end)
            rounds.append({"round": rnd + 1, **round_counts.as_dict(),
                           "idle_after_s": round(waited, 1)})
            for key in ("outcomes", "errors", "by_endpoint"):
                getattr(counts, key).update(getattr(round_counts, key))
            counts.chunks += round_counts.chunks
            print(f"round {rnd + 1}: {fmt_outcomes(round_counts.as_dict())}; idle after "
                  f"{waited:.0f} s", flush=True)
        final_metrics = await server.metrics(http) if "error" not in gauges else {}
    final = {**gauges, "blocks": block_counts(gauges, server.info),
             "request_success": {labels: v for labels, v in
                                 final_metrics.get("tokenmill:request_success_total", [])},
             "preemptions": sum(v for _, v in final_metrics.get(
                 "tokenmill:num_preemptions_total", [])),
             "generation_tokens": sum(v for _, v in final_metrics.get(
                 "tokenmill:generation_tokens_total", []))}
    return {"counts": counts.as_dict(), "rounds": rounds, "series": series, "final": final}


# ----- verdict and report -----------------------------------------------------------------------

def verdict(result: dict, args) -> dict:
    """``tokenmill.bench.verdicts.soak_verdict`` on this run (errors, leaked blocks, growth)."""
    limits = SoakLimits(args.warmup, args.max_growth)
    return soak_verdict(result["series"], result["final"], result["counts"]["errors"], limits)


def fmt_header() -> str:
    return (f"{'t (s)':>7}  {'phase':<14} {'RSS MiB':>8} {'private':>8} {'anon':>8} "
            f"{'file':>6} {'shmem':>6} {'thr':>4}  {'running':>7} {'waiting':>7} {'KV use':>7} "
            f"{'free/blocks':>13}")


def fmt_row(row: dict) -> str:
    def num(key: str, width: int, digits: int = 1) -> str:
        v = row.get(key)
        return f"{v:>{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"

    kv = row.get("kv_cache_usage")
    kv_text = f"{100 * kv:.2f}%" if isinstance(kv, (int, float)) else "-"
    free, total = row.get("free_blocks"), row.get("blocks")
    blocks = f"{free:.0f}/{total:.0f}" if free is not None and total is not None else "-"
    return (f"{row['t_s']:>7.0f}  {row['phase']:<14} {num('rss_mib', 8)} "
            f"{num('private_mib', 8)} {num('anon_mib', 8)} {num('file_mib', 6)} "
            f"{num('shmem_mib', 6)} {num('threads', 4, 0)}  {num('running', 7, 0)} "
            f"{num('waiting', 7, 0)} {kv_text:>7} {blocks:>13}"
            + (f"  {row['error']}" if "error" in row else ""))


def fmt_outcomes(counts: dict) -> str:
    parts = [f"{v} {k}" for k, v in sorted(counts["outcomes"].items(), key=lambda kv: -kv[1])]
    text = f"{counts['requests']} requests: " + ", ".join(parts)
    if counts["errors"]:
        text += " (errors: " + ", ".join(f"{v}x {k}" for k, v in counts["errors"].items()) + ")"
    return text


def summarize_dumps(dumps: Path) -> dict:
    """What changed between the first idle dump after load and the last one."""
    files = sorted(dumps.glob("dump-*.json"))
    rows = [json.loads(f.read_text()) for f in files]
    out = {"dir": str(dumps), "points": []}
    for f, d in zip(files, rows):
        m, s = d.get("malloc", {}), d.get("status", {})
        point = {"dump": f.stem, "rss_mib": round(s.get("VmRSS", 0) / MIB, 1),
                 "anon_mib": round(s.get("RssAnon", 0) / MIB, 1),
                 "malloc_in_use_mib": round(m.get("uordblks", 0) / MIB, 1),
                 "malloc_free_retained_mib": round(m.get("fordblks", 0) / MIB, 1),
                 "malloc_mmapped_mib": round(m.get("hblkhd", 0) / MIB, 1),
                 "arenas": m.get("num_arenas"), "threads": s.get("Threads"),
                 "python_objects": d.get("objects", {}).get("_total"),
                 "tensors": d.get("tensors", {}).get("count"),
                 "tensor_mib": round(d.get("tensors", {}).get("bytes", 0) / MIB, 1),
                 "tracemalloc_mib": round(d["tracemalloc"]["current"] / MIB, 1)
                 if "tracemalloc" in d else None}
        if "malloc_trim" in d:
            t = d["malloc_trim"]
            point["malloc_trim_gave_back_mib"] = round(
                (t["before"].get("VmRSS", 0) - t["after"].get("VmRSS", 0)) / MIB, 1)
        out["points"].append(point)
    if len(rows) >= 3:  # dump 0 is before any load; compare the first idle point with the last
        a, b = rows[1], rows[-1]
        grown = {k: b["objects"].get(k, 0) - a["objects"].get(k, 0)
                 for k in set(a["objects"]) | set(b["objects"]) if k != "_total"}
        out["object_growth"] = dict(sorted(((k, v) for k, v in grown.items() if v),
                                           key=lambda kv: -abs(kv[1]))[:15])
        changed = {}
        for key in set(a["containers"]) | set(b["containers"]):
            for attr, n in b["containers"].get(key, {}).items():
                before = a["containers"].get(key, {}).get(attr, 0)
                if n != before:
                    changed[f"{key}.{attr}"] = [before, n]
        out["container_changes"] = changed
        out["lru_caches"] = b.get("lru_caches", {})
        snaps = [dumps / f"{files[i].stem}.tracemalloc" for i in (1, len(files) - 1)]
        if all(p.exists() for p in snaps):
            import tracemalloc

            first, last = (tracemalloc.Snapshot.load(str(p)) for p in snaps)
            out["tracemalloc_growth"] = [
                {"where": str(st.traceback[0]), "size_diff_kib": round(st.size_diff / 1024, 1),
                 "count_diff": st.count_diff}
                for st in last.compare_to(first, "lineno")[:15]]
    return out


def machine_facts() -> dict:
    from machine import machine  # benchmarks/machine.py

    import torch

    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=False,
                              cwd=HERE.parent).stdout.strip()

    changed = [line[3:] for line in git("status", "--porcelain", "tokenmill").splitlines()]
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                  if line.startswith("Model name")), None)
    mem = next((int(line.split()[1]) * 1024 for line in
                Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal")), 0)
    return {**machine(), "lscpu_model_name": model, "cores": os.cpu_count(),
            "memory_gib": round(mem / 1024 ** 3, 1), "python": platform.python_version(),
            "torch": torch.__version__, "tokenmill_commit": git("rev-parse", "--short", "HEAD"),
            "tokenmill_uncommitted": changed,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def report(data: dict, args) -> None:
    print()
    m, c, f, v = data["machine"], data["counts"], data["final"], data["verdict"]
    print(f"machine: {m.get('lscpu_model_name') or m.get('cpu')} "
          f"({', '.join(m.get('isa', [])) or 'no AVX2'}), {m['cores']} cores; "
          f"{data['config']['clients']} clients x {data['config']['duration_s']} s x "
          f"{data['config']['rounds']} round(s)")
    print(f"requests: {fmt_outcomes(c)}; {c['stream_chunks']} stream chunks")
    reasons = {k.split('"')[1]: int(v) for k, v in f.get("request_success", {}).items()}
    print(f"server: finished {reasons}, {f.get('generation_tokens', 0):.0f} tokens generated, "
          f"{f.get('preemptions', 0):.0f} preemptions")
    b = f.get("blocks", {})
    blocks = (f"{b['free']:.0f} of {b['total']:.0f} KV blocks free or evictable "
              f"({b['prefix_cached']:.0f} held by the prefix cache)" if b.get("free") is not None
              else f"{b.get('total', '?')} KV blocks; free/evictable counts {b['source']}")
    print(f"final: running={f.get('running')} waiting={f.get('waiting')} "
          f"kv_cache_usage={f.get('kv_cache_usage')}; {blocks}")
    g = v["memory_growth"]
    if g["mib_per_hour"] is not None:
        print(f"private memory (RSS less the KV cache's shared pages) after the {args.warmup:g} s "
              f"warm-up: {g['first_last_mib'][0]:.0f} -> {g['first_last_mib'][1]:.0f} MiB over "
              f"{g['samples']} samples from {g['from_s']:.0f} s, {g['mib_per_hour']:+.0f} "
              f"MiB/hour (Theil-Sen; limit {args.max_growth:g})")
    print(f"verdict: {'clean' if v['clean'] else 'NOT CLEAN: ' + '; '.join(v['problems'])}")
    if "dumps" in data:
        print("\ndumps (server-side, at idle points):")
        for point in data["dumps"]["points"]:
            print("  " + json.dumps(point))
        for key in ("object_growth", "container_changes", "lru_caches", "tracemalloc_growth"):
            if data["dumps"].get(key):
                print(f"  {key}: {json.dumps(data['dumps'][key], indent=1)}")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_serve":  # the --debug-dumps wrapper
        return serve_with_dumps(sys.argv[2], sys.argv[3:])
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Unknown flags are passed to `tokenmill serve`.")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="what `tokenmill serve` loads")
    ap.add_argument("--url", default=None, help="load a running server instead of starting one")
    ap.add_argument("--pid", type=int, default=None, help="with --url: the server's pid")
    ap.add_argument("--port", type=int, default=8150, help="port of the started server")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--duration", type=float, default=300, help="seconds of load per round")
    ap.add_argument("--rounds", type=lambda v: max(1, int(v)), default=1,
                    help="load rounds with idle pauses between them (at least 1)")
    ap.add_argument("--max-prompt", type=int, default=256,
                    help="longest random prompt, tokens (shared-prefix prompts: 264 to 320)")
    ap.add_argument("--sample-every", type=float, default=15, help="seconds between samples")
    ap.add_argument("--disconnect", type=float, default=0.2,
                    help="share of requests that drop the connection after 1-4 chunks")
    ap.add_argument("--timeout", type=float, default=0.1,
                    help="share with a client deadline of 0.2-2 s")
    ap.add_argument("--cancel", type=float, default=0.1,
                    help="share of non-streaming requests cancelled after 0.1-3 s")
    ap.add_argument("--idle-timeout", type=float, default=120,
                    help="seconds the server gets to become idle after the load")
    ap.add_argument("--settle", type=float, default=5, help="seconds idle before the sample")
    ap.add_argument("--onednn-cache", type=int, default=0,
                    help="entries of oneDNN's two shape caches in the started server (0: what "
                         "tokenmill serve chooses; a variable already set wins)")
    ap.add_argument("--warmup", type=float, default=SoakLimits.warmup_s,
                    help="seconds of load before memory growth counts")
    ap.add_argument("--max-growth", type=float, default=SoakLimits.max_growth_mib_per_hour,
                    help="MiB per hour resident memory may grow after the warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "soak.json")
    ap.add_argument("--debug-dumps", action="store_true",
                    help="server-side dumps (objects, malloc, caches) at the idle points")
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                    help="with --debug-dumps: run the server with PYTHONTRACEMALLOC=FRAMES")
    ap.add_argument("--no-trim-at-end", dest="trim_at_end", action="store_false",
                    help="with --debug-dumps: skip malloc_trim(0) at the last idle point")
    args, serve_flags = ap.parse_known_args()
    serve_flags = [f for f in serve_flags if f != "--"]
    if args.url and serve_flags:
        ap.error(f"--url: nothing is started, so {' '.join(serve_flags)} cannot be passed on")
    if args.url and args.debug_dumps:
        ap.error("--debug-dumps needs the server this script starts")
    if args.disconnect + args.timeout + args.cancel > 1:
        ap.error("--disconnect + --timeout + --cancel must not exceed 1")

    import httpx

    dumps = None
    running = None
    stop_on_sigterm()
    try:
        if args.url:
            server = Server(args.url, args.pid or find_listener(args.url))
            if not server.pid:
                print("no pid for the server (give --pid): memory is not sampled",
                      file=sys.stderr)
        else:
            if args.debug_dumps:
                dumps = args.out.parent / (args.out.stem + "-dumps")
                if dumps.exists():
                    for old in dumps.iterdir():
                        old.unlink()
            peer = SoakPeer(args.model, serve_flags, dumps, args.tracemalloc, args.onednn_cache)
            t0 = time.monotonic()
            running = start_peer(peer, HERE, args.port, args.out.parent / "logs")
            print(f"tokenmill up at {running.url} in {time.monotonic() - t0:.0f} s "
                  f"(log: {running.log})", flush=True)
            server = Server(running.url, running.proc.pid)
        server.model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
        result = asyncio.run(soak(server, args, dumps))
    finally:
        if running is not None:
            running.stop()
    data = {"machine": machine_facts(),
            "config": {"model": server.model, "url": args.url, "started": running is not None,
                       "serve_flags": serve_flags, "clients": args.clients,
                       "duration_s": args.duration, "rounds": args.rounds,
                       "sample_every_s": args.sample_every, "disconnect": args.disconnect,
                       "timeout": args.timeout, "cancel": args.cancel, "seed": args.seed,
                       "max_prompt": args.max_prompt, "onednn_cache": args.onednn_cache,
                       "warmup_s": args.warmup, "max_growth_mib_per_hour": args.max_growth,
                       "server_info": server.info,
                       "memory_env": {k: v for k, v in os.environ.items()
                                      if k.startswith(("MALLOC_", "PYTHONMALLOC", "OMP_",
                                                       "PYTHONTRACEMALLOC", "ONEDNN_", "DNNL_",
                                                       "LRU_CACHE_CAPACITY"))}},
            **result}
    data["verdict"] = verdict(data, args)
    if dumps is not None:
        data["dumps"] = summarize_dumps(dumps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2))
    report(data, args)
    print(f"wrote {args.out}")
    return 0 if data["verdict"]["clean"] else 1


if __name__ == "__main__":
    sys.exit(main())
