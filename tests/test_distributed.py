"""Tensor and pipeline parallel ranks (``executor/multiproc.py``) on a tiny random model: the
logits of every step against one process's, greedy decoding over 64 steps, and the engine's
features (prefix cache, chunked prefill, preemption, speculative decoding, structured output,
seeded ``n > 1``; int8 weights and KV within their rounding) giving one process's outputs.

The model (4 layers, 8 heads of 32 dimensions, 4 or 2 KV heads, a 257-token byte vocabulary
that no TP size divides) is written by the tests; every run is float32, where splitting a sum
over ranks moves logits by rounding only. The servers are in test_distributed_serve.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.plan import make_plan
from tokenmill.executor.control import micro_batches
from tokenmill.executor.multiproc import MultiprocExecutor
from tokenmill.runner.batch import Chunk

BASE = dict(dtype="float32", block_size=4, max_model_len=128)
NUM_BLOCKS = 96  # block 0 pads; three sequences of 24 blocks (96 tokens), then 16 more
PROMPTS = [list(b"The quick brown fox"), list(b"tensor"), list(b"0123456789" * 3)]
FIRST_PART = 16  # the third prompt's prefill runs in two chunks, the first scoring nothing
STEPS = 64


def write_tiny_llama(directory: Path, kv_heads: int) -> Path:
    """A random 4-layer llama with 8 heads of 32 dimensions (the CPU attention kernel's
    smallest, so the fused step runs it) over a byte-level tokenizer (256 bytes and ``<eos>``:
    257 tokens, so the vocabulary is padded at every TP size)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tests.tiny_models import make_hf_model, save_hf_model

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    save_hf_model(make_hf_model("llama", seed=kv_heads, num_hidden_layers=4, eos_token_id=256,
                                num_attention_heads=8, num_key_value_heads=kv_heads,
                                hidden_size=256, intermediate_size=128,
                                vocab_size=tok.get_vocab_size()), directory)
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return directory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[int, str]:
    """Per number of KV heads (4: split at TP=2 and 4; 2: replicated at TP=4), the model."""
    return {kv: str(write_tiny_llama(tmp_path_factory.mktemp(f"tiny_kv{kv}"), kv))
            for kv in (4, 2)}


@contextmanager
def ranks(model: str, **options) -> Iterator[MultiprocExecutor]:
    """The multi-process executor the engine would start for ``options``, stopped after."""
    plan = make_plan(EngineConfig.from_options(model, **BASE, num_blocks=NUM_BLOCKS, **options))
    executor = MultiprocExecutor(plan.distributed_spec())
    try:
        yield executor
    finally:
        executor.shutdown()


# ----- a scripted greedy run: one forward per step, the caller's forward ------------------------

@dataclass
class Run:
    tokens: list[list[int]]  # per prompt, the greedy tokens
    logits: list[torch.Tensor]  # per step, the logits of the scored positions


def greedy_run(forward: Callable[[list[Chunk]], torch.Tensor], steps: int = STEPS) -> Run:
    """Three sequences decoded together for ``steps`` steps after their prefill (the third's in
    two chunks, so a step mixes a prefill, a chunk without logits and decodes)."""
    seqs = [list(p) for p in PROMPTS]
    fed = [0] * len(seqs)
    tables = [list(range(1 + 24 * i, 25 + 24 * i)) for i in range(len(seqs))]
    tokens: list[list[int]] = [[] for _ in seqs]
    seen = []
    for _ in range(steps + 1):
        chunks, scored = [], []
        for i, seq in enumerate(seqs):
            end = FIRST_PART if i == 2 and fed[i] == 0 else len(seq)
            chunks.append(Chunk(seq[fed[i]:end], fed[i], tables[i], int(end == len(seq))))
            scored += [i] * (end == len(seq))
            fed[i] = end
        logits = forward(chunks)
        seen.append(logits)
        assert logits.shape == (len(scored), 257)
        for i, row in zip(scored, logits):
            seqs[i].append(int(row.argmax()))
            tokens[i].append(seqs[i][-1])
    return Run([t[:steps] for t in tokens], seen)


def in_parts(forward: Callable[[list[Chunk]], torch.Tensor], parts: int):
    """``forward`` over a step's micro-batches one after the other (as pipeline stages run
    them), the logits joined: the same GEMM shapes as the stages'."""
    def run(chunks: list[Chunk]) -> torch.Tensor:
        out, start = [], 0
        for size in micro_batches([len(c.token_ids) for c in chunks], parts):
            out.append(forward(chunks[start:start + size]))
            start += size
        return torch.cat(out)
    return run


@pytest.fixture(scope="module")
def one_process(tiny) -> Callable[[int, bool, int], Run]:
    """``(kv heads, enforce_eager, micro-batches) -> Run`` of the model in this process (the
    runner the uni-process executor builds), each computed once."""
    from tokenmill.executor.worker import build_worker

    runners, runs = {}, {}

    def run(kv: int, eager: bool, parts: int) -> Run:
        if (kv, eager) not in runners:
            plan = make_plan(EngineConfig.from_options(tiny[kv], **BASE, num_blocks=NUM_BLOCKS,
                                                       enforce_eager=eager))
            worker = build_worker(plan.worker_spec())
            assert worker.cpu_step.startswith("eager" if eager else "fused"), worker.cpu_step
            runners[kv, eager] = worker.runner
        if (kv, eager, parts) not in runs:
            runs[kv, eager, parts] = greedy_run(in_parts(runners[kv, eager].forward, parts))
        return runs[kv, eager, parts]

    return run


def assert_runs_match(ref: Run, got: Run, exact: bool) -> None:
    """Step by step (the first difference is reported before the tokens part ways)."""
    for step, (a, b) in enumerate(zip(ref.logits, got.logits)):
        if exact:
            assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max():.3g}"
        else:
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0, msg=lambda m: f"step {step}: {m}")
    assert got.tokens == ref.tokens


# (kv heads, tp, pp, enforce_eager): the fused C++ step is what a float32 CPU engine runs. Two
# layouts stay in the fast loop (-m "not slow"); each of the others starts 2-4 more processes.
_slow = pytest.mark.slow
LAYOUTS = [
    pytest.param(4, 2, 1, False, id="tp2"), pytest.param(4, 1, 2, False, id="pp2"),
    pytest.param(4, 4, 1, False, id="tp4", marks=_slow),
    pytest.param(2, 4, 1, False, id="tp4-kv-replicated", marks=_slow),
    pytest.param(4, 2, 2, False, id="tp2xpp2", marks=_slow),
    pytest.param(4, 2, 1, True, id="tp2-eager", marks=_slow),
    pytest.param(4, 1, 2, True, id="pp2-eager", marks=_slow),
]


def test_the_gloo_all_reduce_computes_what_one_process_does(tiny, one_process):
    """--disable-custom-all-reduce: the TP sums go through gloo (the path across hosts), the
    layers layer by layer (the C++ step cannot call gloo)."""
    with ranks(tiny[4], tensor_parallel_size=2, disable_custom_all_reduce=True) as executor:
        info = executor.describe()
        assert info["all_reduce"] == "gloo"
        assert info["cpu_step"].startswith("eager: the TP group all-reduces through gloo")
        assert_runs_match(one_process(4, False, 1), greedy_run(executor.logits), exact=False)


@pytest.mark.parametrize("kv, tp, pp, eager", LAYOUTS)
def test_ranks_compute_what_one_process_does(tiny, one_process, kv, tp, pp, eager):
    """TP: logits within 1e-4 (the all-reduce sums partial products in another order) and the
    same greedy tokens over 64 steps. PP: bit for bit what one process computes over the same
    micro-batches (a batch's rows are not bit-stable across GEMM shapes, so the reference runs
    the stages' micro-batches), and the same tokens as one batch."""
    with ranks(tiny[kv], tensor_parallel_size=tp, pipeline_parallel_size=pp,
               enforce_eager=eager) as executor:
        info = executor.describe()
        assert info["cpu_step"].startswith("eager" if eager else "fused"), info["cpu_step"]
        assert info["all_reduce"] == ("shared memory" if tp > 1 else "none")
        assert info["stage_layers"] == [4 // pp] * pp
        assert [r["layers"] for r in info["ranks"].values()] == \
            [[s * 4 // pp, (s + 1) * 4 // pp] for s in range(pp) for _ in range(tp)]
        assert {r["kv_blocks"] for r in info["ranks"].values()} == {NUM_BLOCKS}
        got = greedy_run(executor.logits)
        assert_runs_match(one_process(kv, eager, pp), got, exact=tp == 1)
        assert got.tokens == one_process(kv, eager, 1).tokens
        assert_a_step_may_score_nothing(executor)


def assert_a_step_may_score_nothing(executor: MultiprocExecutor) -> None:
    """A chunked prefill's first part wants no logits: the step returns none, and the next
    goes on from the KV it wrote (blocks past the greedy run's)."""
    prompt, first, second = PROMPTS[2], list(range(73, 81)), list(range(81, 89))
    empty = executor.logits([Chunk(prompt[:FIRST_PART], 0, first, 0)])
    rest = executor.logits([Chunk(prompt[FIRST_PART:], FIRST_PART, first, 1)])
    whole = executor.logits([Chunk(prompt, 0, second, 1)])
    assert empty.shape == (0, 257)
    torch.testing.assert_close(rest, whole, atol=1e-5, rtol=0)


# ----- the engine's features under TP / PP, against one process --------------------------------

SCHEMA = {"type": "object", "properties": {
    "a": {"enum": [1, 22, 333]}, "b": {"type": "boolean"},
    "c": {"type": "string", "maxLength": 5}}, "required": ["a", "b", "c"],
    "additionalProperties": False}
TEXTS = ["Once upon a time there was a", "tensor parallel ranks split heads",
         "abcabcabcabcabcabc abcabc", "0123456789 0123456789 0123"] + \
        [f"request number {i} says hello" for i in range(6)]
REPEATED = "the prefix cache holds this prompt"
# Each configuration runs in one process and on parallel ranks. float32 throughout, so the
# ranks' outputs equal one process's token for token -- except with int8 codes, which the
# ranks' float rounding (1e-6) flips now and then, and int8 activations, which a row-parallel
# rank quantizes over its slice of the row (its own scale): there, a greedy run may part from
# one process's only at a near tie.
FEATURES = {
    # 40 blocks for 10 requests of ~14 blocks: preemption; 16 tokens a step: chunked prefill;
    # ngram drafts every step (adaptive drafting decides by timing, which differs between runs)
    "scheduling": dict(num_blocks=40, max_num_batched_tokens=16, max_num_seqs=8,
                       speculative_method="ngram", speculative_adaptive=False),
    "int8": dict(num_blocks=128, quantization="int8", kv_cache_dtype="int8"),
}
FEATURE_LAYOUTS = {"scheduling": [(1, 1), (2, 1), (1, 2)], "int8": [(1, 1), (2, 1)]}
NEAR_TIE = 0.1  # int8: the largest logprob gap a divergence may start at


@dataclass
class Workload:
    greedy: list  # CompletionOutput per prompt (token ids, top-5 logprobs)
    repeated: list[list[int]]  # a prompt run twice, alone: the second from the prefix cache
    cached_tokens: list[int]
    sampled: list[list[list[int]]]  # n = 3, seeded
    structured: list[str]
    stats: object
    info: object


def run_workload(llm) -> Workload:
    from tokenmill.params import SamplingParams, StructuredOutputs

    greedy = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)
    batch = llm.generate(TEXTS, greedy, use_tqdm=False)
    stats = llm.engine.stats()
    repeated = [llm.generate(REPEATED, greedy, use_tqdm=False)[0] for _ in range(2)]
    sampled = llm.generate(TEXTS[:2], SamplingParams(max_tokens=16, n=3, seed=7),
                           use_tqdm=False)
    structured = llm.generate(TEXTS[:3], SamplingParams(
        max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputs(json=SCHEMA)),
        use_tqdm=False)
    return Workload([r.outputs[0] for r in batch],
                    [r.outputs[0].token_ids for r in repeated],
                    [r.num_cached_tokens for r in repeated],
                    [[o.token_ids for o in r.outputs] for r in sampled],
                    [r.outputs[0].text for r in structured], stats, llm.engine.info)


@pytest.fixture(scope="module")
def workloads(tiny) -> dict[tuple[str, int, int], Workload]:
    """Per (configuration, tp, pp), the workload's results; one engine at a time."""
    from tokenmill.engine.llm import LLM

    out = {}
    for name, options in FEATURES.items():
        for tp, pp in FEATURE_LAYOUTS[name]:
            llm = LLM(tiny[4], **BASE, **options, tensor_parallel_size=tp,
                      pipeline_parallel_size=pp)
            try:
                out[name, tp, pp] = run_workload(llm)
            finally:
                llm.engine.shutdown()
    return out


def parts_at_near_ties(ref: list, got: list, tolerance: float) -> int:
    """How many runs part from one process's (4 of 10 at TP=2 for int8 when written); each
    where its token was within ``tolerance`` (logprob) of one process's choice, among one
    process's top 5."""
    parted = 0
    for a, b in zip(ref, got):
        i = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
        if i is not None:
            top = dict(a.logprobs[i].top)
            assert b.token_ids[i] in top, (i, a.token_ids[i], b.token_ids[i], top)
            assert top[a.token_ids[i]] - top[b.token_ids[i]] <= tolerance, (i, top)
            parted += 1
    return parted


def assert_structured(texts: list[str]) -> None:
    for text in texts:
        value = json.loads(text)
        assert value["a"] in (1, 22, 333) and isinstance(value["b"], bool)
        assert len(value["c"]) <= 5


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, pp", [(n, tp, pp) for n, layouts in FEATURE_LAYOUTS.items()
                                          for tp, pp in layouts if tp * pp > 1])
def test_features_under_parallel_ranks_match_one_process(workloads, name, tp, pp):
    ref, got = workloads[name, 1, 1], workloads[name, tp, pp]
    assert got.info.parallel["tensor_parallel_size"] == tp
    assert got.info.parallel["pipeline_parallel_size"] == pp
    assert got.repeated[0] == got.repeated[1]
    assert got.cached_tokens[0] == 0 and got.cached_tokens[1] > 0  # the prefix cache's hit
    assert len({tuple(s) for s in got.sampled[0]}) > 1  # three samples, not one thrice
    assert_structured(got.structured)
    if name == "int8":
        parts_at_near_ties(ref.greedy, got.greedy, NEAR_TIE)
        return
    assert [o.token_ids for o in got.greedy] == [o.token_ids for o in ref.greedy]
    assert got.repeated == ref.repeated
    assert got.sampled == ref.sampled
    assert got.structured == ref.structured


@pytest.mark.slow
def test_the_features_ran(workloads):
    """What the configurations are there for happened, on the ranks too."""
    for tp, pp in FEATURE_LAYOUTS["scheduling"]:
        stats = workloads["scheduling", tp, pp].stats
        assert stats.num_preemptions > 0, (tp, pp)
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, (tp, pp)
    for tp, pp in FEATURE_LAYOUTS["int8"]:
        info = workloads["int8", tp, pp].info
        assert info.quantization.startswith("int8") and info.kv_cache_dtype == "int8"
