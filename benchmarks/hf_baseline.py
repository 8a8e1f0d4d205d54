"""Baseline: the same requests one at a time through plain transformers ``generate``.

    python benchmarks/hf_baseline.py --num-prompts 32 --input-len 128 --output-len 128

Loads the default GGUF through transformers (dequantized to float32), greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch
    import transformers

    from tokenmill.model_source import resolve_model

    path = resolve_model("smollm2-135m-instruct").path
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    start = time.perf_counter()
    out_tokens = 0
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
            out_tokens += out.shape[1] - len(p)
    elapsed = time.perf_counter() - start
    print(json.dumps({"engine": "transformers generate, one request at a time",
                      "num_prompts": args.num_prompts, "elapsed_s": round(elapsed, 2),
                      "output_tokens": out_tokens,
                      "output_tokens_per_s": round(out_tokens / elapsed, 2)}, indent=2))


if __name__ == "__main__":
    main()
