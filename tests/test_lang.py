"""``tokenmill.lang`` against a real ``tokenmill serve`` on 127.0.0.1 (greedy, the default
model), and its fallbacks against a scripted OpenAI-compatible server (httpx mock transport)."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from tests.test_server_support import MODEL, metrics, server_fixtures, wait_idle
from tokenmill import lang

# float32: select's logprobs are compared with a float32 transformers scoring
server, client = server_fixtures("--max-num-seqs", "16", "--dtype", "float32")

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def endpoint(server):
    e = lang.Endpoint(server.url)
    yield e
    e.close()


@lang.function
def capital(s, country):
    s += f"The capital of {country} is"
    s += lang.gen("city", max_tokens=6, temperature=0, stop=".")


def test_gen_equals_the_completion_endpoint(endpoint, client):
    state = capital.run(country="France", backend=endpoint)
    direct = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                       temperature=0, stop=".")
    assert state["city"] == direct.choices[0].text
    assert state.text() == PROMPT + direct.choices[0].text
    assert state.get_meta_info("city")["finish_reason"] == direct.choices[0].finish_reason


def test_chat_turns_and_constraints(endpoint, client):
    @lang.function
    def quiz(s):
        s += lang.system("You answer briefly.")
        s += lang.user("Name a color.")
        s += lang.assistant(lang.gen("color", max_tokens=8, temperature=0))
        s += lang.user("Give a number.")
        with s.assistant():
            s += lang.gen("number", max_tokens=6, regex=r"[0-9]{1,3}", temperature=0)
        s += lang.user("Answer as JSON.")
        s += lang.assistant(lang.gen("obj", max_tokens=40, temperature=0, json_schema={
            "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))

    state = quiz.run(backend=endpoint)
    messages = [{"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": "Name a color."}]
    direct = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            temperature=0)
    assert state["color"] == direct.choices[0].message.content
    assert state["number"].isdigit()
    assert isinstance(json.loads(state["obj"])["ok"], bool)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"] * 1 + [
        "user", "assistant", "user", "assistant"]

    @lang.function
    def chat_pick(s):
        s += lang.user("Is the sky blue? Reply yes or no.")
        s += lang.assistant(lang.select("yn", ["yes", "no"]))

    picked = chat_pick.run(backend=endpoint)  # a chat cannot be scored: constrained choice
    assert picked["yn"] in ("yes", "no") and picked.get_meta_info("yn")["method"] == "choice"


def test_select_by_constrained_choice(endpoint):
    @lang.function
    def pick(s):
        s += "Q: Is the sky blue on a clear day? Answer yes or no.\nA:"
        s += lang.select("answer", [" yes", " no", " maybe"], method="choice")

    state = pick.run(backend=endpoint)
    assert state["answer"] in (" yes", " no", " maybe")
    assert state.get_meta_info("answer")["method"] == "choice"
    assert state.text().endswith(state["answer"])


def test_select_by_prompt_logprobs_matches_transformers(endpoint, request):
    """The choice a transformers scoring ranks first (summed log-likelihood of each choice's
    tokens after the context, float32)."""
    if not endpoint.supports("prompt_logprobs"):
        pytest.xfail("the server does not return prompt logprobs yet (echo + max_tokens 0)")
    import torch

    model, tok = request.getfixturevalue("hf_default_float32")
    context = "The largest planet in the solar system is"
    choices = [" Jupiter", " Mars", " Venus", " Earth"]

    @lang.function
    def planet(s):
        s += context
        s += lang.select("p", choices, normalize=False)

    state = planet.run(backend=endpoint)
    meta = state.get_meta_info("p")
    reference = []
    with torch.no_grad():
        for choice in choices:
            ids = tok(context + choice, return_tensors="pt").input_ids
            n_ctx = len(tok(context).input_ids)
            logits = model(ids).logits.float().log_softmax(-1)[0]
            reference.append(sum(logits[i - 1, ids[0, i]].item()
                                 for i in range(n_ctx, ids.shape[1])))
    assert meta["method"] == "logprob"
    assert state["p"] == choices[max(range(len(choices)), key=reference.__getitem__)]
    assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(meta["logprobs"], reference)), (
        meta, reference)


def test_fork4_computes_the_shared_prefix_once(server, endpoint):
    """Four branches over a 512-token prefix: the prefix is computed by the commit request
    only; each branch finds it in the prefix cache (server counters)."""
    words = " ".join(f"w{i}" for i in range(400))
    prefix = "Context: " + words
    n = httpx.post(f"{server.url}/tokenize", json={"prompt": prefix}).json()["count"]
    assert n >= 512

    @lang.function
    def branches(s):
        s += prefix
        forks = s.fork(4)
        forks += [f"\nBranch {i}:" for i in range(4)]
        forks += lang.gen("out", max_tokens=3, temperature=0, ignore_eos=True)
        forks.join()
        s += "".join(f["out"] for f in forks)

    wait_idle(server.url)
    httpx.post(f"{server.url}/flush_cache").raise_for_status()
    before = metrics(server.url)
    branches.run(backend=endpoint)
    after = metrics(server.url)

    def delta(name):
        return after[(name, ())] - before.get((name, ()), 0)

    computed = delta("tokenmill:prefix_cache_queries_total") - delta(
        "tokenmill:prefix_cache_hits_total")
    assert delta("tokenmill:prefix_cache_hits_total") >= 4 * (n - 16)
    assert computed < n + 4 * 32  # the prefix once, then each branch's own tail


def test_run_batch_and_streaming(endpoint, client):
    states = capital.run_batch([{"country": c} for c in ("France", "Italy", "Spain")],
                               backend=endpoint, num_threads=3)
    for country, state in zip(("France", "Italy", "Spain"), states):
        direct = client.completions.create(model=MODEL, prompt=f"The capital of {country} is",
                                           max_tokens=6, temperature=0, stop=".")
        assert state["city"] == direct.choices[0].text

    @lang.function
    def story(s):
        s += "Once upon a time"
        s += lang.gen("rest", max_tokens=8, temperature=0, ignore_eos=True)

    whole = story.run(backend=endpoint)
    streamed = story.run(backend=endpoint, stream=True)
    pieces = list(streamed.text_iter())
    assert "".join(pieces) == whole.text()
    assert len(pieces) > 3  # the prompt, then the generated text in pieces
    assert "".join(streamed.text_iter("rest")) == streamed["rest"] == whole["rest"]


def test_server_errors_raise_program_errors(endpoint):
    @lang.function
    def bad(s):
        s += "x"
        s += lang.gen("a", max_tokens=4, regex="(unclosed")
        s += lang.gen("b", max_tokens=4)

    with pytest.raises(lang.ProgramError) as e:
        bad.run(backend=endpoint)
    assert e.value.status == 400 and "regex" in str(e.value).lower()
    states = bad.run_batch([{}], backend=endpoint)
    with pytest.raises(lang.ProgramError):
        states[0]["a"]
    with pytest.raises(KeyError, match="no variable"):
        capital.run(country="France", backend=endpoint)["nothing"]


# ----- a plain OpenAI-compatible server (scripted): the fallbacks --------------------------

def scripted(handler) -> lang.Endpoint:
    return lang.Endpoint("http://fake", model="m", transport=httpx.MockTransport(handler))


def test_select_degrades_on_a_server_without_structured_output():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if body.get("echo") or "structured_outputs" in body or "guided_choice" in body:
            return httpx.Response(400, json={"error": {"message": "Unrecognized argument"}})
        return httpx.Response(200, json={"choices": [
            {"index": 0, "text": " no, it is not", "finish_reason": "length"}]})

    @lang.function
    def pick(s):
        s += "Is it?"
        s += lang.select("a", [" yes", " no"])

    state = pick.run(backend=scripted(handler))
    assert state["a"] == " no"
    assert state.get_meta_info("a")["method"] == "free"
    assert [("echo" in b, "structured_outputs" in b, "guided_choice" in b) for b in seen] == [
        (True, False, False), (False, True, False), (False, False, True),
        (False, False, False)]


def test_select_by_scripted_prompt_logprobs():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = []
        for i, p in enumerate(prompts):
            # "ctx" then one token per further character: " a" is 2 tokens, " bb" 3
            tokens = ["ctx"] + list(p[3:])
            values = [None] + [-1.0 if p.endswith("a") else -0.6] * (len(tokens) - 1)
            offsets = [0] + list(range(3, len(p)))
            choices.append({"index": i, "text": p, "logprobs": {
                "tokens": tokens, "token_logprobs": values, "text_offset": offsets}})
        return httpx.Response(200, json={"choices": choices})

    @lang.function
    def pick(s, normalize):
        s += "ctx"
        s += lang.select("a", [" a", " bbb"], normalize=normalize)

    e = scripted(handler)
    by_mean = pick.run(normalize=True, backend=e)
    assert by_mean["a"] == " bbb" and by_mean.get_meta_info("a")["num_tokens"] == [2, 4]
    assert pick.run(normalize=False, backend=e)["a"] == " a"  # -2.0 beats -2.4


def test_misuse_is_refused_clearly():
    with pytest.raises(ValueError):
        lang.select("a", [])
    with pytest.raises(ValueError):
        lang.gen("a", max_tokens=0)

    @lang.function
    def mixed(s):
        s += lang.user("hi")
        s += lang.gen("a")  # outside assistant()

    e = scripted(lambda r: httpx.Response(500))
    with pytest.raises(lang.ProgramError, match="inside assistant"):
        mixed.run(backend=e)
    with pytest.raises(RuntimeError, match="no backend"):
        lang.Program(lambda s: None).run()


def test_import_tokenmill_does_not_import_lang():
    import subprocess
    import sys

    code = "import sys, tokenmill; print('tokenmill.lang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "False"


# ----- the examples run ----------------------------------------------------------------------

def example(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "examples" / "lang" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"lang_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_examples_run(endpoint):
    voted = example("self_consistency").vote.run(question="What is 2 + 2?", paths=3,
                                                 reasoning_tokens=12, backend=endpoint)
    assert len(voted["answers"]) == 3 and voted["majority"] in voted["answers"]
    judge = example("judge")
    judged = judge.judge.run(question="What is 2 + 2?", answer="4", backend=endpoint)
    assert all(judged[c][0] in ("yes", "no") for c in judge.CRITERIA)
    agent = example("tool_loop").agent.run(task="What is 17+25?", max_steps=2,
                                           backend=endpoint)
    assert agent.text().startswith("Task: What is 17+25?") and "answer" in agent.variables()


def test_forks_stream_and_their_streams_end():
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if not body.get("stream"):  # the fork's commit of the shared text
            return httpx.Response(200, json={"choices": [{"index": 0, "text": "."}]})
        chunks = [{"choices": [{"index": 0, "text": piece}]} for piece in (" one", " two")]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    @lang.function
    def two(s):
        s += "a shared context that is long enough to be worth committing once " * 2
        forks = s.fork(2)
        forks += [" left:", " right:"]
        forks += lang.gen("g", max_tokens=4)
        s.set_var("forks", forks)

    state = two.run(backend=scripted(handler), stream=True)
    forks = state["forks"]
    assert [list(f.text_iter("g")) for f in forks] == [[" one", " two"]] * 2
    assert "".join(forks[1].text_iter()).endswith(" right: one two")
    assert forks[0]["g"] == " one two"
