"""Grammar libraries compared on the default model's vocabulary: llguidance and xgrammar.

    python3 benchmarks/grammar_backends.py [MODEL] [--steps 160] [--out FILE]

For every case of ``tests/structured_cases.py`` (22 JSON schemas, 10 regexes) plus two schemas
with keywords a library may not implement (``uniqueItems``, ``propertyNames``), each library:

- compiles the case (schema or regex to a matcher at its start state; timed cold, once);
- walks it at random (fixed seed): fill the next-token bitmask (only the fill is timed, not
  reading the bits back), pick an allowed token at random, or end with probability
  ``--eos-prob`` where EOS is allowed, for at most ``--steps`` tokens.

Prints a row per case, then per library: tokenizer set-up seconds, compile ms mean/max,
mask-fill us mean/p50/p99/max, and the cases it refused with its message. JSON schemas are
compiled as tokenmill compiles them: no whitespace beyond the canonical separators and objects
closed to unlisted keys (tokenmill's ``closed_objects``; xgrammar's strict mode does the same).
xgrammar is optional: without it the script measures llguidance alone and says so.
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from machine import machine  # noqa: E402  (benchmarks/machine.py)
from structured_cases import REGEXES, SCHEMAS  # noqa: E402

from tokenmill.structured.backend import closed_objects  # noqa: E402
from tokenmill.tokenizer import load_tokenizer  # noqa: E402

# Cases outside the shared corpus: keywords a library may refuse rather than enforce.
UNSUPPORTED = {
    "unique_items": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True,
                     "maxItems": 4},
    "property_names": {"type": "object", "propertyNames": {"pattern": "^[a-z]+$"},
                       "maxProperties": 3, "additionalProperties": {"type": "integer"}},
}


class Refused(Exception):
    """The library does not compile this case."""


class Llguidance:
    name, modules = "llguidance", ("llguidance", "llguidance.torch")

    def __init__(self, tokenizer_json: str, vocab: int, eos: int):
        import llguidance
        import llguidance.torch

        self.llg, self._fill = llguidance, llguidance.torch.fill_next_token_bitmask
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str, spec):
        m = self.llg.LLMatcher
        grammar = (m.grammar_from_json_schema(json.dumps(closed_objects(spec)),
                                              defaults={"whitespace_flexible": False})
                   if kind == "json" else m.grammar_from_regex(spec))
        matcher = m(self.tokenizer, grammar)
        if matcher.is_error():
            raise Refused(matcher.get_error())
        return matcher

    def fill(self, matcher) -> None:
        self._fill(matcher, self.bitmask, 0)

    def accept(self, matcher, token: int) -> None:
        if not matcher.consume_token(token):
            raise AssertionError(f"llguidance rejected a token its mask allowed: "
                                 f"{matcher.get_error()}")


class Xgrammar:
    name, modules = "xgrammar", ("xgrammar", "transformers")

    def __init__(self, hf_tokenizer, vocab: int, eos: int):
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        wrapped = PreTrainedTokenizerFast(tokenizer_object=hf_tokenizer)
        info = xgrammar.TokenizerInfo.from_huggingface(wrapped, vocab_size=vocab,
                                                       stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def compile(self, kind: str, spec):
        try:
            compiled = (self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False)
                        if kind == "json" else self.compiler.compile_regex(spec))
        except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError and others)
            raise Refused(str(e).strip().splitlines()[0]) from None
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask)

    def accept(self, matcher, token: int) -> None:
        if not matcher.accept_token(token):
            raise AssertionError(f"xgrammar rejected token {token} its mask allowed")


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def walk(lib, matcher, rng: random.Random, vocab: int, eos: int, steps: int,
         eos_prob: float) -> list[float]:
    """Seconds of each mask fill along one random path through the grammar."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        lib.fill(matcher)
        seconds.append(time.perf_counter() - start)
        allowed = allowed_tokens(lib.bitmask, vocab)
        others = allowed[allowed != eos]
        if len(others) == 0 or (len(others) < len(allowed) and rng.random() < eos_prob):
            break  # the grammar is complete (or dead), or the walk chose to end it
        lib.accept(matcher, int(others[rng.randrange(len(others))]))
    return seconds


def measure(lib, cases, args, vocab: int, eos: int) -> dict:
    per_case, refused, masks = {}, {}, []
    for kind, name, spec in cases:
        start = time.perf_counter()
        try:
            matcher = lib.compile(kind, spec)
        except Refused as e:
            refused[name] = str(e)
            continue
        compile_ms = 1e3 * (time.perf_counter() - start)
        seconds = walk(lib, matcher, random.Random(args.seed), vocab, eos, args.steps,
                       args.eos_prob)
        masks += seconds
        per_case[name] = {"compile_ms": compile_ms, "masks": len(seconds),
                          "mask_us_mean": 1e6 * statistics.fmean(seconds)}
    compiles = [c["compile_ms"] for c in per_case.values()] or [float("nan")]
    us = np.array(masks or [float("nan")]) * 1e6
    return {"compile_ms_mean": statistics.fmean(compiles), "compile_ms_max": max(compiles),
            "slowest_compile": max(per_case, key=lambda n: per_case[n]["compile_ms"],
                                   default=None),
            "masks": len(masks), "mask_us_mean": float(us.mean()),
            "mask_us_p50": float(np.percentile(us, 50)),
            "mask_us_p99": float(np.percentile(us, 99)), "mask_us_max": float(us.max()),
            "refused": refused, "cases": per_case}


def setup(cls, *init_args) -> tuple[object, float] | None:
    """The library ready for the vocabulary, and the seconds that took (imports excluded)."""
    try:
        for module in cls.modules:
            importlib.import_module(module)
    except ImportError as e:
        print(f"{cls.name}: not installed ({e}), skipped")
        return None
    start = time.perf_counter()
    lib = cls(*init_args)
    return lib, time.perf_counter() - start


def print_report(libraries: dict) -> None:
    cases = dict.fromkeys(n for r in libraries.values() for n in [*r["cases"], *r["refused"]])
    print(f"\n{'case':18}" + "".join(f" {n[:11] + ' ms':>14} {'mask us':>8} {'masks':>5}"
                                      for n in libraries))
    for case in cases:
        cells = []
        for r in libraries.values():
            c = r["cases"].get(case)
            cells.append(f" {c['compile_ms']:14.2f} {c['mask_us_mean']:8.1f} {c['masks']:5d}"
                         if c else f" {'refused':>14} {'':8} {'':5}")
        print(f"{case:18}" + "".join(cells))
    print(f"\n{'':11} {'init s':>6} {'compile ms mean':>15} {'max':>6} {'mask us mean':>12}"
          f" {'p50':>6} {'p99':>7} {'max':>7} {'masks':>6}")
    for name, r in libraries.items():
        print(f"{name:11} {r['init_s']:6.2f} {r['compile_ms_mean']:15.2f} "
              f"{r['compile_ms_max']:6.1f} {r['mask_us_mean']:12.1f} {r['mask_us_p50']:6.1f} "
              f"{r['mask_us_p99']:7.1f} {r['mask_us_max']:7.0f} {r['masks']:6d}")
    for name, r in libraries.items():
        for case, why in r["refused"].items():
            print(f"{name} refuses {case}: {why}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=160, help="most tokens per random walk")
    ap.add_argument("--eos-prob", type=float, default=0.3, help="chance of ending where allowed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--out", type=Path, help="write the results here as JSON")
    args = ap.parse_args()

    tok = load_tokenizer(args.model)
    vocab, eos = tok.backend.get_vocab_size(), tok.backend.token_to_id(tok.eos_token)
    cases = [("json", n, s) for n, s in {**SCHEMAS, **UNSUPPORTED}.items()] + \
        [("regex", n, r) for n, r in REGEXES.items()]
    if args.cases:
        cases = [c for c in cases if c[1] in args.cases.split(",")]
    result = {"machine": machine(), "model": args.model, "vocab_size": vocab, "eos": eos,
              "torch_threads": torch.get_num_threads(), "steps": args.steps,
              "eos_prob": args.eos_prob, "seed": args.seed, "libraries": {}}
    print(json.dumps(result["machine"]))
    print(f"{len(cases)} cases, vocabulary {vocab}, EOS {eos}, walks of at most {args.steps}")
    for cls, init_args in ((Llguidance, (tok.backend.to_str(), vocab, eos)),
                           (Xgrammar, (tok.backend, vocab, eos))):
        ready = setup(cls, *init_args)
        if ready is not None:
            lib, init_s = ready
            result["libraries"][cls.name] = {"init_s": init_s,
                                             **measure(lib, cases, args, vocab, eos)}
    print_report(result["libraries"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
