"""lm-evaluation-harness against a real ``tokenmill serve``: a multiple-choice task through its
``local-completions`` model (prompt scoring: ``echo`` + ``logprobs``, token ids in batches) and
a ``generate_until`` task through ``local-chat-completions``, both written as local JSONL files
(``tests/data/lm_eval_*.jsonl``), must give the answers a transformers float32 scoring of the
same items gives.

Nothing reaches the network: the tasks read local files, the hub and datasets run offline, the
tokenizer lm-eval needs is the default model's, saved to a folder, and any connection leaving
this machine fails the test. The server runs in float32, where its log-likelihoods equal
transformers' to 1e-4 (in bf16 two close choices could swap places)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from tests.test_server_support import MODEL, server_fixtures

lm_eval = pytest.importorskip("lm_eval")

pytestmark = pytest.mark.slow

server, _client = server_fixtures("--dtype", "float32")

DATA = Path(__file__).parent / "data"
MC_TASK = """\
task: tokenmill_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: tokenmill_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 10
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _local_only(monkeypatch) -> list[str]:
    """Offline hub and datasets, and a socket that refuses any address but this machine's;
    the list of addresses refused (a library may catch the error and carry on: the test then
    fails on the list)."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    connect, refused = socket.socket.connect, []

    def guarded(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and \
                address[0] not in ("127.0.0.1", "::1", "localhost"):
            refused.append(str(address[0]))
            raise OSError(f"test_lm_eval: no network ({address[0]})")
        return connect(sock, address)
    monkeypatch.setattr(socket.socket, "connect", guarded)
    return refused


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    (folder / "mc.yaml").write_text(MC_TASK.format(path=DATA / "lm_eval_mc.jsonl"))
    (folder / "gen.yaml").write_text(GEN_TASK.format(path=DATA / "lm_eval_gen.jsonl"))
    return folder


@pytest.fixture(scope="module")
def tokenizer_dir(hf_default_float32, tmp_path_factory):
    """The default model's tokenizer as a folder: what lm-eval's huggingface backend loads."""
    folder = tmp_path_factory.mktemp("tokenizer")
    hf_default_float32[1].save_pretrained(folder)
    return folder


def _evaluate(task: str, model: str, model_args: dict, tasks: Path, **kw) -> list[dict]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(model=model, model_args=model_args, tasks=[task],
                          task_manager=TaskManager(include_path=str(tasks),
                                                   include_defaults=False),
                          log_samples=True, **kw)
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def _docs(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()]


def _continuation_logprobs(hf, context: str, continuations: list[str]) -> list[float]:
    """log p(continuation | context) for each, as lm-eval asks for it (each pair tokenized
    whole, the context's tokens first), in one padded forward."""
    model, tok = hf
    n = len(tok.encode(context, add_special_tokens=False))
    seqs = [tok.encode(context + c, add_special_tokens=False) for c in continuations]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logp = model(ids, attention_mask=mask).logits.float().log_softmax(-1)
    return [sum(logp[j, i - 1, s[i]].item() for i in range(n, len(s)))
            for j, s in enumerate(seqs)]


def test_multiple_choice_through_local_completions(server, tasks, tokenizer_dir,
                                                   hf_default_float32, monkeypatch):
    refused = _local_only(monkeypatch)
    samples = _evaluate("tokenmill_mc", "local-completions", {
        "model": MODEL, "base_url": f"{server.url}/v1/completions",
        "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_dir),
        "num_concurrent": 2, "batch_size": 4, "max_retries": 1}, tasks)
    assert refused == []
    docs = _docs("lm_eval_mc.jsonl")
    assert len(samples) == len(docs)
    for sample, doc in zip(samples, docs, strict=True):
        context = f"Question: {doc['question']}\nAnswer:"
        want = _continuation_logprobs(hf_default_float32, context,
                                      [f" {c}" for c in doc["choices"]])
        got = [resp[0] for resp in sample["filtered_resps"]]
        assert got == pytest.approx(want, abs=1e-3), doc
        assert max(range(4), key=got.__getitem__) == max(range(4), key=want.__getitem__)


def _greedy(hf, question: str, until: tuple[str, ...], max_tokens: int) -> str:
    """transformers' greedy answer in the chat template, cut where the server stops: at an end
    token or a stop string."""
    model, tok = hf
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                     add_generation_prompt=True)
    ids = tok.encode(prompt, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
    new = out[0, len(ids):].tolist()
    ends = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    new = new[:next((i for i, t in enumerate(new) if t in ends), len(new))]
    text = tok.decode(new)
    for stop in until:
        text = text.split(stop)[0]
    return text


def test_generate_until_through_local_chat_completions(server, tasks, hf_default_float32,
                                                       monkeypatch):
    refused = _local_only(monkeypatch)
    samples = _evaluate("tokenmill_gen", "local-chat-completions", {
        "model": MODEL, "base_url": f"{server.url}/v1/chat/completions",
        "num_concurrent": 2, "max_retries": 1}, tasks, apply_chat_template=True)
    assert refused == []
    docs = _docs("lm_eval_gen.jsonl")
    assert len(samples) == len(docs)
    for sample, doc in zip(samples, docs, strict=True):
        want = _greedy(hf_default_float32, doc["question"], ("\n", "."), 10)
        assert sample["filtered_resps"][0] == want, doc
        assert sample["exact_match"] == float(want.strip() == doc["answer"])
