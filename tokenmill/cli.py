"""The ``tokenmill`` command: ``generate`` (and, as they land, ``serve``, ``chat``, ``bench``).

The only place that reads the environment and turns user input into config objects.
"""

from __future__ import annotations

import argparse
import sys
import time

from tokenmill.config import DEFAULT_MODEL
from tokenmill.errors import TokenmillError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"a .gguf file, a Hugging Face directory or a known name "
                        f"(default: {DEFAULT_MODEL})")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: float32 on CPU, bfloat16 on CUDA)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    _add_model_args(gen)
    gen.add_argument("--prompt", action="append", required=True, help="repeatable")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message with the model's chat template")
    gen.set_defaults(func=_cmd_generate)
    return parser


def _default_dtype(device: str, dtype: str | None) -> str:
    if dtype:
        return dtype
    # bf16/fp16 matmuls are emulated (very slow) on most CPUs.
    return "bfloat16" if device.startswith("cuda") else "float32"


def _cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.model.loader import load_model
    from tokenmill.runner.model_runner import ModelRunner
    from tokenmill.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    loaded = load_model(args.model, args.device, _default_dtype(args.device, args.dtype))
    tok = load_tokenizer(args.model)
    print(f"loaded {loaded.source.path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    for prompt in args.prompt:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
        ids = tok.encode(text, add_special_tokens=not args.chat)
        blocks = -(-(len(ids) + args.max_tokens) // 16)
        runner = ModelRunner(loaded, num_blocks=blocks, block_size=16, device=args.device)
        out = runner.greedy_generate(ids, args.max_tokens, frozenset(tok.eos_token_ids))
        print(tok.decode(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TokenmillError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
