"""Every script in benchmarks/ imports as it does when run (``python3 benchmarks/x.py``): what
a script takes from the package or the tests moves with them, and the suite runs none of them
(they take minutes). Importing runs no benchmark: each runs under ``__name__ == "__main__"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = sorted((Path(__file__).resolve().parent.parent / "benchmarks").glob("*.py"))

# One interpreter for all of them (torch is imported once): for each script, sys.path as a run
# of it starts (its folder first; the checkout's root not on it), its module under a name of
# its own in sys.modules (dataclasses look it up); {script: error} for those that fail.
IMPORT_ALL = """
import importlib.util, json, sys, traceback
base, failed = list(sys.path[1:]), {}
for path in sys.argv[1:]:
    sys.path[:] = [path.rsplit("/", 1)[0], *base]
    name = "_benchmark_" + path.rsplit("/", 1)[1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if '__name__ == "__main__"' in open(path).read() and not callable(
                getattr(module, "main", None)):
            failed[path] = "a script without main()"
    except BaseException:
        failed[path] = traceback.format_exc(limit=-3)
print(json.dumps(failed))
"""


def test_every_benchmark_script_imports(tmp_path):
    assert len(BENCHMARKS) >= 20
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL, *map(str, BENCHMARKS)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    failed = json.loads(run.stdout.splitlines()[-1])
    assert not failed, "\n".join(f"{path}:\n{why}" for path, why in failed.items())


def test_vllm_attention_cases_share_only_the_prefix_blocks():
    """benchmarks/peers/vllm_attention.py's layout (it runs in vLLM's environment, which the
    suite lacks): sequences hold the shared prefix's blocks in common and every other block
    alone; each new token's slot is its position's, in its own block."""
    sys.path.insert(0, str(BENCHMARKS[0].parent / "peers"))
    try:
        from vllm_attention import paged_layout
    finally:
        sys.path.pop(0)
    shapes = [(1024, 64), (1099, 1), (1030, 2)]
    tables, starts, slots = paged_layout(shapes, shared_tokens=1024, block=128)
    assert starts == [0, 64, 65, 67]
    assert [len(t) for t in tables] == [9, 9, 9]  # ceil(tokens / 128)
    assert tables[0][:8] == tables[1][:8] == tables[2][:8] == list(range(8))
    own = [t[8] for t in tables]
    assert sorted(own) == [8, 9, 10]  # one block each past the prefix
    assert slots[:2] == [own[0] * 128, own[0] * 128 + 1]  # position 1024: its first own slot
    assert slots[64] == own[1] * 128 + 1099 % 128  # position 1099
    assert slots[65:] == [own[2] * 128 + 6, own[2] * 128 + 7]
    assert len(set(slots)) == len(slots) == 67
    no_prefix = paged_layout([(0, 40), (5, 1)], shared_tokens=0, block=16)
    assert no_prefix == ([[0, 1, 2], [3]], [0, 40, 41], [*range(40), 3 * 16 + 5])
