"""Structured output: the constraint data, the grammar backend, and the engine with the real
default model (masks, jump-forward, n > 1, stop strings, preemption, logprobs)."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from tests.fakes import run_collecting_failures
from tokenmill import LLM, SamplingParams, StructuredOutputs
from tokenmill.structured.backend import GrammarBackend, GrammarError, closed_objects
from tokenmill.structured.spec import ConstraintError, from_request
from tokenmill.tokenizer import load_tokenizer

from .structured_cases import REGEXES, SCHEMAS, regex_prompt, schema_prompt

MODEL = "smollm2-135m-instruct"
PERSON = SCHEMAS["person"]


# ----- constraints as data ----------------------------------------------------------------------

def test_exactly_one_constraint():
    with pytest.raises(ConstraintError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ConstraintError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ConstraintError, match="choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(ConstraintError, match="JSON only"):
        StructuredOutputs(regex="a", whitespace_pattern=" ?")
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": PERSON})


def test_equal_constraints_share_a_key_and_property_order_is_kept():
    a = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputs(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    assert a.key == b.key
    assert list(json.loads(a.json)["properties"]) == ["b", "a"]  # output order, not sorted


def test_request_fields_map_to_one_constraint():
    assert from_request(response_format={"type": "text"}) is None
    assert from_request(response_format={"type": "json_object"}).kind == "json_object"
    spec = from_request(response_format={"type": "json_schema",
                                         "json_schema": {"name": "p", "schema": PERSON}})
    assert spec.kind == "json" and json.loads(spec.json) == PERSON
    assert from_request(structured_outputs={"regex": "[a-z]+"}).regex == "[a-z]+"
    assert from_request(structured_outputs={"choice": ["x", "y"]}).choice == ("x", "y")
    assert from_request(guided_grammar='root ::= "a"').kind == "grammar"
    assert from_request(guided_json=PERSON, guided_whitespace_pattern="[ ]?") \
        .whitespace_pattern == "[ ]?"
    with pytest.raises(ConstraintError) as e:
        from_request(guided_regex="a", response_format={"type": "json_object"})
    assert e.value.param == "guided_regex"
    with pytest.raises(ConstraintError) as e:
        from_request(response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(ConstraintError, match="structural_tag"):
        from_request(structured_outputs={"structural_tag": "{}"})
    with pytest.raises(ConstraintError, match="type"):
        from_request(response_format={"type": "yaml"})


def test_objects_are_closed_unless_the_schema_opens_them():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {}}},
              "$defs": {"d": {"properties": {"x": {}}, "additionalProperties": True}},
              "allOf": [{"properties": {"y": {}}}]}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["allOf"][0]
    assert "additionalProperties" not in schema  # a copy


# ----- the grammar backend ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def backend():
    tok = load_tokenizer(MODEL)
    return tok, GrammarBackend(tok.backend.to_str(), 49152, [2])


@pytest.mark.parametrize("spec, words", [
    (StructuredOutputs(json={"type": "objectx"}), "objectx"),
    (StructuredOutputs(json='{"type": '), "not valid JSON"),
    (StructuredOutputs(regex="a(b"), "unclosed group"),
    (StructuredOutputs(grammar="root ::= ("), "Expected"),
    (StructuredOutputs(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
])
def test_bad_constraints_name_the_field(backend, spec, words):
    with pytest.raises(GrammarError, match=words) as e:
        backend[1].compile(spec)
    assert e.value.param == "structured_outputs"


def test_compiled_once_per_key(backend):
    _, b = backend
    before = b.stats.num_compiled
    first = b.compile(StructuredOutputs(regex="[0-9]{3}"))
    assert b.compile(StructuredOutputs(regex="[0-9]{3}")) is first
    assert b.stats.num_compiled == before + 1


def slow_schema(num_properties: int, tag: str) -> dict:
    """An object of integer properties: llguidance compiles ~3,000 a second (4,000: 2.5 s on
    a 2-core Xeon), where a small constraint takes milliseconds."""
    return {"type": "object",
            "properties": {f"{tag}_{i}": {"type": "integer"} for i in range(num_properties)}}


def test_a_slow_compile_holds_up_neither_hits_nor_other_constraints(backend):
    """While a large schema compiles (in two threads: it compiles once), a cached constraint
    is returned and a new small one compiles: nothing waits behind the slow one."""
    _, b = backend
    cached = b.compile(StructuredOutputs(regex="[a-f]{4}"))
    slow = StructuredOutputs(json=slow_schema(4000, "backend"))
    before = b.stats.num_compiled
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: b.compile(slow)}))
               for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)  # the slow compile is under way (it takes seconds)
    assert b.compile(StructuredOutputs(regex="[a-f]{4}")) is cached
    b.compile(StructuredOutputs(regex="[g-k]{5}"))
    assert all(t.is_alive() for t in threads), "the hit or the small compile waited for it"
    for t in threads:
        t.join()
    assert results[0] is results[1]
    assert b.stats.num_compiled == before + 2


def test_masks_forced_text_and_draft_rows(backend):
    tok, b = backend
    grammar = b.compile(StructuredOutputs(choice=["yes please", "no"])).matcher()
    words = torch.zeros(3, 49152 // 32, dtype=torch.int32)
    yes = tok.encode("yes please", add_special_tokens=False)
    grammar.fill_masks(yes[:2], words, 0)  # rows after "", after yes[0], after yes[:2]

    def allowed(row):
        return {32 * w + i for w, x in enumerate(words[row].tolist()) for i in range(32)
                if x >> i & 1}
    assert yes[0] in allowed(0) and tok.encode("no", add_special_tokens=False)[0] in allowed(0)
    assert 2 not in allowed(0)  # EOS only where the grammar may end
    assert yes[1] in allowed(1)
    assert allowed(2) == {2}  # "yes please" is complete: only the end
    assert grammar.valid_prefix(yes) == len(yes)  # the draft rows were rolled back
    grammar.accept(yes[:1])
    assert tok.decode(yes[:1] + grammar.forced_tokens()) == "yes please"
    grammar.accept(yes[1:])
    assert grammar.is_stopped


# ----- the engine with the real model -------------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, num_blocks=512, block_size=16, max_num_seqs=64)


def chat_prompt(llm, text):
    return llm.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_every_schema_and_regex_greedy_and_sampled(llm):
    """All 22 schemas and 10 regexes, greedy and at temperature 1, in one batch each. Greedy
    output ends on its own and matches; a sampled one may instead run to max_tokens inside an
    unbounded string (a map's key, free text), and then its tokens are a prefix the grammar
    allows; most sampled outputs still end on their own."""
    prompts, params, checks = [], [], []
    for temperature in (0.0, 1.0):
        for name, schema in SCHEMAS.items():
            prompts.append(chat_prompt(llm, schema_prompt(name)))
            params.append(SamplingParams(temperature=temperature, max_tokens=256, seed=1,
                                         structured_outputs=StructuredOutputs(json=schema)))
            checks.append(lambda text, s=schema: jsonschema.validate(json.loads(text), s))
        for name, regex in REGEXES.items():
            prompts.append(chat_prompt(llm, regex_prompt(name)))
            params.append(SamplingParams(temperature=temperature, max_tokens=64, seed=1,
                                         structured_outputs=StructuredOutputs(regex=regex)))
            checks.append(lambda text, r=regex: re.fullmatch(r, text) or pytest.fail(text))
    outs = llm.generate(prompts, params, use_tqdm=False)
    cut = 0
    for out, p, check in zip(outs, params, checks):
        c = out.outputs[0]
        if c.finish_reason == "length" and p.temperature > 0:
            grammar = llm.engine.compile_grammar(p.structured_outputs).matcher()
            assert grammar.valid_prefix(c.token_ids) == len(c.token_ids), c.text
            cut += 1
            continue
        assert c.finish_reason == "stop", c.text
        check(c.text)
    assert cut <= len(outs) // 8


def test_jump_forward_keeps_greedy_output_in_fewer_steps(llm):
    schema = SCHEMAS["long_fixed_keys"]
    params = SamplingParams(temperature=0.0, max_tokens=200, logprobs=1,
                            structured_outputs=StructuredOutputs(json=schema))
    prompts = [chat_prompt(llm, schema_prompt("long_fixed_keys")),
               chat_prompt(llm, "Fill in a customer record.")]
    runs = {}
    engine = llm.engine
    for jump in (False, True):
        engine.structured.jump_forward = jump
        before = engine.stats()
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        after = engine.stats()
        runs[jump] = (outs, after.num_steps - before.num_steps,
                      after.num_accepted_tokens - before.num_accepted_tokens)
    engine.structured.jump_forward = True
    (plain, plain_steps, plain_accepted), (jumped, jumped_steps, accepted) = runs[False], runs[True]
    assert [o.token_ids for o in jumped] == [o.token_ids for o in plain]
    assert [len(o.logprobs) for o in jumped] == [len(o.token_ids) for o in jumped]
    assert plain_accepted == 0 and accepted > 20
    assert jumped_steps < plain_steps - 20
    for o in jumped:
        jsonschema.validate(json.loads(o.text), schema)


def test_n_samples_each_follow_the_grammar(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=64, seed=3,
                            structured_outputs=StructuredOutputs(json=PERSON))
    out = llm.generate(chat_prompt(llm, "Invent a person."), params, use_tqdm=False)[0]
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1


def test_stop_string_inside_constrained_output(llm):
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=['"age"'],
                            structured_outputs=StructuredOutputs(json=PERSON))
    out = llm.generate(chat_prompt(llm, "Invent a person."), params, use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == '"age"'
    assert c.text.startswith('{"name":"') and '"age"' not in c.text


def test_choice_and_grammar_and_min_tokens(llm):
    prompt = chat_prompt(llm, "Is water wet?")
    choice = SamplingParams(temperature=1.0, max_tokens=10, seed=0, min_tokens=5,
                            structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    texts = [o.outputs[0].text for o in llm.generate([prompt] * 6, choice, use_tqdm=False)]
    assert set(texts) <= {"yes", "no"}  # min_tokens cannot hold the end the grammar forces
    endless = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                             structured_outputs=StructuredOutputs(choice=["yes", "no"]))
    out = llm.generate(prompt, endless, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"  # the grammar ended it
    assert not set(out.token_ids) & llm.engine.eos_token_ids
    gbnf = 'root ::= "answer: " [0-9] [0-9]?'
    grammar = SamplingParams(temperature=0.0, max_tokens=10,
                             structured_outputs=StructuredOutputs(grammar=gbnf))
    text = llm.generate(prompt, grammar, use_tqdm=False)[0].outputs[0].text
    assert re.fullmatch(r"answer: [0-9][0-9]?", text)


@pytest.mark.slow  # the real model
def test_preemption_keeps_grammar_state():
    """Too few blocks for the batch: sequences are preempted and recomputed, their grammar
    states stay with their tokens, and the outputs equal an unpreempted run."""
    params = SamplingParams(temperature=0.0, max_tokens=80,
                            structured_outputs=StructuredOutputs(json=SCHEMAS["recipe"]))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, t] for t in range(100, 108)]
    roomy = LLM(MODEL, num_blocks=256, block_size=16, dtype="float32")
    small = LLM(MODEL, num_blocks=20, block_size=16, max_num_seqs=8, dtype="float32")
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    got = small.generate(prompts, params, use_tqdm=False)
    assert small.engine.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS["recipe"])


def test_json_object_and_whitespace_pattern(llm):
    prompt = chat_prompt(llm, "Give a JSON object with a name and an age.")
    anything = SamplingParams(temperature=0.0, max_tokens=80,
                              structured_outputs=StructuredOutputs(json_object=True))
    out = llm.generate(prompt, anything, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict)
    for pattern, allowed in ((None, ""), (r"[ \n]{0,2}", " \n")):
        spec = StructuredOutputs(json=PERSON, whitespace_pattern=pattern)
        text = llm.generate(prompt, SamplingParams(temperature=1.0, max_tokens=80, seed=4,
                                                   structured_outputs=spec),
                            use_tqdm=False)[0].outputs[0].text
        jsonschema.validate(json.loads(text), PERSON)
        outside = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)  # whitespace outside strings
        assert set(re.findall(r"\s", outside)) <= set(allowed)
        assert not re.search(r"\s{3}", outside)


def test_auto_tool_grammar_checks_calls_and_leaves_text_free(backend):
    from tokenmill.server.tools.parsers import get_tool_parser
    from tokenmill.server.tools.choice import tool_choice_constraint

    tok, b = backend
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    call = '<tool_call>\n{"name":"add","arguments":{"a":1}}\n</tool_call>'
    for parallel in (True, False):
        grammar = b.compile(tool_choice_constraint(tools, "auto", parallel,
                                                   get_tool_parser("hermes")))

        def valid(text):
            ids = tok.encode(text, add_special_tokens=False)
            return grammar.matcher().valid_prefix(ids) == len(ids)
        assert valid("Just text, a < b, <tool and all.")
        assert valid(f"Let me add.{call}") and valid(f"{call} done.")
        assert not valid('Sure.<tool_call>\n{"name":"sub"')  # not an offered function
        assert not valid('<tool_call>\n{"name":"add","arguments":{"a":"one"}}')
        assert valid(f"{call}\n{call}")
        # A second call is checked too with parallel calls; without, text after the first is
        # free (the server keeps only the first call).
        assert valid(f'{call} then <tool_call>\n{{"name":"x"') == (not parallel)


@pytest.mark.slow
def test_the_engine_loop_takes_no_compile_lock_for_a_compiled_grammar(llm):
    """``add_request`` with the grammar compiled already (as the server sends it), or with a
    cached constraint, returns while another thread holds the backend's lock."""
    engine = llm.engine
    spec = StructuredOutputs(choice=["yes", "no"])
    params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec)
    grammar = engine.compile_grammar(spec)
    prompt = chat_prompt(llm, "Yes or no?")
    added = threading.Event()

    def add() -> None:
        engine.add_request("precompiled", prompt, params, grammar=grammar)
        engine.add_request("cached", prompt, params)
        added.set()

    adder = threading.Thread(target=add)
    with engine.structured.backend._lock:  # as a compile of old held it, for seconds
        adder.start()
        assert added.wait(30), "add_request waited on the compile lock"
    adder.join()
    finished, failures = run_collecting_failures(engine)
    assert not failures and sorted(finished) == ["cached", "precompiled"]
    assert {o.outputs[0].text for o in finished.values()} <= {"yes", "no"}
    other = engine.compile_grammar(StructuredOutputs(regex="[0-9]+"))
    with pytest.raises(ValueError, match="not the request's constraint"):
        engine.add_request("mismatch", prompt, params, grammar=other)
    assert not engine.has_unfinished_requests()


def test_bad_constraint_queues_nothing(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputs(regex="(("))
    with pytest.raises(GrammarError):
        llm.engine.add_request("bad", "hi", bad)
    assert not llm.engine.has_unfinished_requests()


def test_a_grammar_that_breaks_fails_its_request_alone(llm, monkeypatch):
    """A matcher raising while the step fills masks fails that request; a plain request and
    another constrained one in the same steps finish."""
    engine = llm.engine
    spec = StructuredOutputs(json=SCHEMAS["recipe"])
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec)
    engine.add_request("plain", chat_prompt(llm, "Hi"),
                       SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("json", chat_prompt(llm, "A recipe"), params)
    engine.add_request("broken", chat_prompt(llm, "A recipe"), params)
    matcher = next(r for r in engine.scheduler.waiting if r.group_id == "broken").grammar

    def fill_masks(*args):
        raise ValueError("draft token 90 breaks the grammar")

    monkeypatch.setattr(matcher, "fill_masks", fill_masks)
    finished, failures = run_collecting_failures(engine)
    assert list(failures) == ["broken"] and "breaks the grammar" in failures["broken"]
    assert sorted(finished) == ["json", "plain"]
    assert len(finished["plain"].outputs[0].token_ids) == 12
    assert engine.stats().kv_cache_usage == 0
