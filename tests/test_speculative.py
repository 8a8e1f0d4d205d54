"""Speculative decoding: the proposers, the adaptive policy, and the engine with each method on the
real default model (greedy output identical, KV accounting) and on tiny random models (the
sampled distribution is the target's, with a deliberately bad draft)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.stats_support import chi_square_p_value
from tests.test_engine_real import GREEDY, PROMPTS, assert_all_blocks_free
from tests.test_engine_unit import make_engine, run
from tokenmill import LLM, SamplingParams, StructuredOutputs
from tokenmill.request import Request
from tokenmill.cache import KVBlockManager
from tokenmill.speculative import AdaptivePolicy, ModelDrafter, NgramProposer, SpeculativeDecoder
from tokenmill.speculative.policy import AcceptanceTracker, LinearCost, StepCost
from tokenmill.util import cdiv

# ----- n-gram lookup ----------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_longest_matching_suffix() -> None:
    p = NgramProposer(min_n=2, max_n=4)
    #         0  1  2  3  4  5  6  7  8
    tokens = [1, 2, 3, 4, 9, 7, 2, 3, 4]
    # suffix (2, 3, 4) ended at 4 earlier: what followed is 9, 7, 2
    assert p.lookup("a", tokens, 3) == [9, 7, 2]
    assert p.lookup("b", tokens, 10) == [9, 7, 2, 3, 4]  # never past the known tokens
    assert p.lookup("c", [5, 6, 7, 8], 3) == []  # nothing repeats
    assert p.lookup("d", [5, 6, 1, 5, 6], 2) == [1, 5]
    assert NgramProposer(min_n=3, max_n=4).lookup("e", [5, 6, 1, 5, 6], 2) == []  # too short


def test_ngram_prefers_the_longest_then_the_latest_match() -> None:
    p = NgramProposer(min_n=1, max_n=3)
    # (8,) occurs at 0 and 3; (1, 8) only at 2-3: the longer match wins
    assert p.lookup("a", [8, 5, 1, 8, 6, 1, 8], 1) == [6]
    # (8,) alone occurs twice: the latest occurrence proposes
    assert p.lookup("b", [8, 5, 8, 6, 8], 1) == [6]


def test_ngram_index_grows_with_the_sequence_like_a_fresh_one() -> None:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=gen).tolist()
    grown = NgramProposer(min_n=2, max_n=5)
    for end in range(1, len(tokens) + 1, 7):
        fresh = NgramProposer(min_n=2, max_n=5)
        assert grown.lookup("s", tokens[:end], 4) == fresh.lookup("s", tokens[:end], 4)


def test_ngram_propose_reads_requests() -> None:
    r = Request("r", [1, 2, 3, 1, 2], SamplingParams())
    r.output_token_ids = [3, 1]
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose([r], {"r": 2}) == {"r": [2, 3]}  # suffix (3, 1) ended at 4
    assert p.propose([r], {"r": 0}) == {}
    p.forget(["r"])
    assert not p._indexes


# ----- the adaptive policy ----------------------------------------------------------------------


def fitted_policy(per_token: float, fixed: float, drafter: bool = False,
                  draft_per_token: float = 0.0, draft_fixed: float = 0.0,
                  token_budget: int | None = None) -> AdaptivePolicy:
    policy = AdaptivePolicy(max_k=5, drafter=drafter, probe_every=32, token_budget=token_budget)
    for tokens in (1, 4, 16, 64, 2, 32):
        policy.target_cost.add(tokens, fixed + per_token * tokens)
        policy.draft_cost.add(tokens, draft_fixed + draft_per_token * tokens)
    return policy


def accepting(policy: AdaptivePolicy, seq_ids, rate: float) -> None:
    """Verifications of 5 drafts, each accepted with probability ``rate`` after the last."""
    import random

    rng = random.Random(0)
    for s in seq_ids:
        for _ in range(40):
            accepted = 0
            while accepted < 5 and rng.random() < rate:
                accepted += 1
            policy.acceptance.record(s, 5, accepted)


def test_linear_cost_fits_a_line() -> None:
    cost = LinearCost()
    for tokens in (1, 8, 3, 40, 12):
        cost.add(tokens, 0.02 + 0.001 * tokens)
    assert cost.a == pytest.approx(0.02, rel=1e-6) and cost.b == pytest.approx(0.001, rel=1e-6)
    assert cost(100) == pytest.approx(0.12)


def test_step_cost_follows_measured_counts_and_extends_by_the_line() -> None:
    cost = StepCost()
    # a CPU-like shape: 1 token 27 ms, 5 tokens 45 ms, then 1 ms per token
    for tokens, ms in ((1, 27), (5, 45), (9, 49), (65, 105)):
        for _ in range(3):
            cost.add(tokens, ms / 1000)
    assert cost(1) == pytest.approx(0.027) and cost(5) == pytest.approx(0.045)
    assert cost(3) == pytest.approx(0.036)  # between measured counts: a straight line
    assert cost(np.array([7, 9])).tolist() == pytest.approx([0.047, 0.049])
    assert cost(165) > cost(65)  # past the table: the fitted slope


def test_policy_probes_caps_it_would_not_pick() -> None:
    policy = fitted_policy(per_token=0.004, fixed=0.03)
    seqs = [f"s{i}" for i in range(64)]
    accepting(policy, seqs, 0.3)
    caps = {max(policy.choose(seqs, 64).values(), default=0) for _ in range(6 * 32)}
    assert caps == {0, 1, 2, 3, 4, 5}  # off almost always, each cap now and then


def test_acceptance_per_sequence_first_and_per_position_after() -> None:
    t = AcceptanceTracker(max_k=4)
    for _ in range(30):
        t.record("a", 4, 4)  # always all four
        t.record("b", 4, 0)  # never the first
    assert t.rate("a") > t.overall > t.rate("b")
    gains = t.gains(["a", "b"])
    # later positions were tried only after accepted ones, and always accepted then
    assert gains[0].tolist() == pytest.approx([t.rate("a")] * 4, rel=0.1)
    assert (np.diff(gains, axis=1) <= 0).all()
    before = t.rate("b")
    for _ in range(50):
        t.step(["b"])  # steps without news: "b" returns to the average
    assert abs(t.rate("b") - t.overall) < abs(before - t.overall) / 10


def test_policy_drafts_deep_alone_when_extra_tokens_are_cheap() -> None:
    policy = fitted_policy(per_token=0.001, fixed=0.03)
    accepting(policy, ["a"], 0.8)
    assert policy.choose(["a"], 1) == {"a": 5}


def test_policy_stops_drafting_when_acceptance_is_poor() -> None:
    policy = fitted_policy(per_token=0.002, fixed=0.03)
    accepting(policy, ["a"], 0.0)
    assert policy.choose(["a"], 1) == {}


def test_policy_turns_off_in_a_large_batch_where_tokens_cost_compute() -> None:
    # 64 sequences at 4 ms a token: a verified draft costs more than the 0.5 token it brings
    policy = fitted_policy(per_token=0.004, fixed=0.03)
    seqs = [f"s{i}" for i in range(64)]
    accepting(policy, seqs, 0.5)
    assert policy.choose(seqs, 64) == {}
    # the same acceptance alone, where the forward is weight-bound: worth it
    assert policy.choose(seqs[:1], 1)


def test_policy_drafts_for_the_sequences_that_accept() -> None:
    policy = fitted_policy(per_token=0.001, fixed=0.03)
    accepting(policy, ["good"], 1.0)
    accepting(policy, ["bad"], 0.0)
    ks = policy.choose(["good", "bad"], 2)
    assert ks.get("good", 0) >= 3 and "bad" not in ks


def test_policy_pays_for_a_drafter_s_rounds() -> None:
    # a draft model as slow as the target: never worth it, however good its drafts
    slow = fitted_policy(per_token=0.001, fixed=0.03, drafter=True, draft_fixed=0.03,
                         draft_per_token=0.001)
    accepting(slow, ["a"], 0.9)
    assert slow.choose(["a"], 1) == {}
    cheap = fitted_policy(per_token=0.001, fixed=0.03, drafter=True, draft_fixed=0.002,
                          draft_per_token=0.0001)
    accepting(cheap, ["a"], 0.9)
    assert cheap.choose(["a"], 1) == {"a": 5}


def test_policy_limits_and_the_non_adaptive_mode() -> None:
    policy = AdaptivePolicy(max_k=4, drafter=False, adaptive=False)
    assert policy.choose(["a", "b"], 2, limits={"a": 2, "b": 9}) == {"a": 2, "b": 4}


def test_policy_leaves_waiting_prompts_their_room_in_the_budget() -> None:
    # cheap extra tokens and good acceptance: alone, a sequence drafts all 5
    policy = fitted_policy(per_token=0.0005, fixed=0.03, token_budget=64)
    accepting(policy, ["a"], 0.9)
    assert policy.choose(["a"], 1) == {"a": 5}
    # drafts go before waiting prompts: only the room the budget leaves them is drafted
    assert policy.choose(["a"], 1, waiting_tokens=61) == {"a": 2}
    assert policy.choose(["a"], 1, waiting_tokens=63) == {}
    assert policy.choose(["a"], 1, waiting_tokens=500) == {}
    # nor while the cost is unmeasured, nor in a probe step
    fresh = AdaptivePolicy(max_k=5, drafter=False, probe_every=1, token_budget=64)
    assert fresh.choose(["a", "b"], 2) == {"a": 5, "b": 5}
    assert fresh.choose(["a", "b"], 2, waiting_tokens=57) == {"a": 3, "b": 2}
    assert fresh.choose(["a", "b"], 2, waiting_tokens=62) == {}
    for tokens in (1, 2, 3):
        fresh.target_cost.add(tokens, 0.03)
    assert all(fresh.choose(["a"], 1, waiting_tokens=63) == {} for _ in range(12))


def test_policy_counts_waiting_prompt_tokens_as_work() -> None:
    # CPU-like cost past a few tokens: 4 ms a token. Alone, 0.9 acceptance pays; beside 200
    # waiting prompt tokens (a step of 0.83 s for 201 tokens of work, 4.1 ms each) a draft's
    # 4 ms for at most 0.9 of a token does not, though the budget has room for it.
    policy = fitted_policy(per_token=0.004, fixed=0.03, token_budget=2048)
    accepting(policy, ["a"], 0.9)
    assert policy.choose(["a"], 1)
    assert policy.choose(["a"], 1, waiting_tokens=200) == {}


# ----- the engine with a saturated queue (real scheduler and proposer, fake runner) ------------

PERIOD = 5  # the fake model continues each prompt's cycle: n-gram lookup is always right


def cyclic_model(request: Request, drafts_before) -> int:
    return [*request.all_token_ids, *drafts_before][-PERIOD]


def test_waiting_prompt_tokens_are_what_the_free_seats_would_admit() -> None:
    engine = make_engine(num_blocks=128, budget=50, max_seqs=3, model=cyclic_model)
    sched = engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompts = [[10 + 5 * i + k % PERIOD for k in range(20)] for i in range(5)]
    run(engine, {"cached": (prompts[0], params)})  # its full prompt blocks stay in the cache
    assert sched.waiting_prompt_tokens() == 0
    engine.add_request("again", prompts[0], params)  # 16 of 20 tokens cached (4 blocks)
    engine.add_request("new", prompts[1], params)
    assert sched.waiting_prompt_tokens() == 4 + 20
    for i in range(2, 5):
        engine.add_request(f"r{i}", prompts[i], params)
    assert sched.waiting_prompt_tokens() == 4 + 20 + 20  # three seats
    engine.step()  # admits 44 tokens' worth; three requests run, two wait without a seat
    assert sched.num_running == 3 and sched.waiting_prompt_tokens() == 0
    small = make_engine(budget=30, max_seqs=3)
    for i in range(3):
        small.add_request(f"r{i}", prompts[i], params)
    assert small.scheduler.waiting_prompt_tokens() == 30  # at most the budget


def test_no_draft_pushes_a_waiting_prompt_out_of_the_step() -> None:
    """A queue whose prompts fill the token budget gets all of it: drafts (always right here,
    so always worth drafting where they cost no prompt its place) run only in steps that
    leave no prompt token behind, and outputs are unchanged."""
    budget, seats = 32, 6
    requests = {f"r{i}": ([10 + 5 * i + k % PERIOD for k in range(20)],
                          SamplingParams(temperature=0.0, max_tokens=24)) for i in range(24)}
    decoder = SpeculativeDecoder(NgramProposer(1, 3), max_k=4, max_num_batched_tokens=budget)
    # a memory-bound step (20 ms and 0.1 ms a token), instead of the fake runner's clock
    decoder.observe = lambda chunks, accepted, n, _s: SpeculativeDecoder.observe(
        decoder, chunks, accepted, n, 0.02 + 1e-4 * n)
    engine = make_engine(num_blocks=512, budget=budget, max_seqs=seats, proposer=decoder,
                         model=cyclic_model)
    steps = {"with drafts": 0, "full, drafts found": 0, "a draft took a prompt's place": 0}
    lookup = NgramProposer(1, 3)  # what the decoder found, seen from outside

    def check(chunks) -> None:  # after schedule(), before the forward
        sched = engine.scheduler
        left_out = any(r.num_computed_tokens < r.num_tokens for r in sched.running) or (
            len(sched.waiting) > 0 and len(sched.running) < seats)
        drafted = sum(len(c.draft_token_ids) for c in chunks)
        steps["a draft took a prompt's place"] += bool(drafted and left_out)
        steps["with drafts"] += drafted > 0
        found = lookup.propose(list(sched.running), dict.fromkeys(
            (r.request_id for r in sched.running if r.num_output_tokens), 4))
        steps["full, drafts found"] += left_out and any(found.values())

    engine.executor.before_execute = check
    outputs = run(engine, requests)
    assert not steps["a draft took a prompt's place"], steps
    assert steps["with drafts"] >= 8 and steps["full, drafts found"] >= 8, steps
    plain = run(make_engine(num_blocks=512, budget=budget, max_seqs=seats,
                            model=cyclic_model), requests)
    assert {r: o.outputs[0].token_ids for r, o in outputs.items()} == \
        {r: o.outputs[0].token_ids for r, o in plain.items()}
    assert decoder.stats().num_accepted_tokens == decoder.stats().num_draft_tokens > 0


# ----- the engine with the real model -------------------------------------------------------------

METHODS = {
    # adaptive off: every step drafts its full k, so verification and rollback run all the time
    "ngram": dict(speculative_method="ngram", prompt_lookup_min=1, speculative_adaptive=False),
    "draft": dict(speculative_method="draft", speculative_model="smollm2-135m-instruct",
                  num_speculative_tokens=3, speculative_adaptive=False),
    # two of 30 layers: a poor draft, so most drafts are rejected and rolled back
    "layerskip": dict(speculative_method="layerskip", speculative_draft_layers=2,
                      speculative_adaptive=False),
}


@pytest.fixture(scope="module")
def plain(fp32_llm):
    return fp32_llm  # the engine tests' float32 engine, without speculation


@pytest.fixture(scope="module")
def alone(fp32_alone):
    return fp32_alone


@pytest.fixture(scope="module", params=list(METHODS))
def spec_llm(request):
    return LLM("smollm2-135m-instruct", num_blocks=512, dtype="float32",
               **METHODS[request.param])


def assert_drafter_empty(llm) -> None:
    drafter = llm.engine.proposer.method
    if isinstance(drafter, ModelDrafter):  # its KV went with the sequences' blocks
        assert not drafter._seqs and not drafter._lookahead
        assert drafter.blocks is llm.engine.scheduler.block_manager


def test_greedy_identical_batched_and_alone(spec_llm, alone):
    before = spec_llm.engine.stats().spec
    batched = spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [a.token_ids for a in alone]
    assert [o.outputs[0].text for o in batched] == [a.text for a in alone]
    # and a speculating sequence alone (every third prompt: the suite's time) the same again
    for prompt, expected in list(zip(PROMPTS, alone))[::3]:
        out = spec_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == expected.token_ids
    stats = spec_llm.engine.stats().spec
    assert stats.num_draft_tokens > before.num_draft_tokens + 100  # it really speculated
    assert stats.num_accepted_tokens > before.num_accepted_tokens
    assert stats.num_accepted_tokens < stats.num_draft_tokens or spec_llm.engine.proposer.name \
        == "draft"  # the draft model is the target itself: everything is accepted
    assert_all_blocks_free(spec_llm.engine)
    assert_drafter_empty(spec_llm)


def test_prefix_cache_serves_only_accepted_kv(spec_llm, alone, plain):
    """After speculation with rejections, the cached blocks of prompt + output give the same
    next token and logprob as a fresh computation."""
    spec_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tok = spec_llm.tokenizer
    # every prompt + 19 of its tokens: its cached blocks were written during speculation
    extended = [tok.encode(p) + a.token_ids[:19] for p, a in zip(PROMPTS, alone)]
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    proposer, spec_llm.engine.proposer = spec_llm.engine.proposer, None
    try:
        hits_before = spec_llm.engine.stats().prefix_cache_hits
        cached = spec_llm.generate(extended, one, use_tqdm=False)
        assert spec_llm.engine.stats().prefix_cache_hits - hits_before >= 16 * 16
    finally:
        spec_llm.engine.proposer = proposer
    fresh = plain.generate(extended, one, use_tqdm=False)
    for c, f, a in zip(cached, fresh, alone):
        assert c.outputs[0].token_ids == [a.token_ids[19]]
        assert c.outputs[0].logprobs[0].logprob == pytest.approx(
            f.outputs[0].logprobs[0].logprob, abs=1e-4)
    assert_all_blocks_free(spec_llm.engine)


def test_stops_max_tokens_logprobs_and_n_inside_accepted_runs(spec_llm, alone):
    # a stop string in the middle of each output: the text ends right before it
    stops = [a.text[len(a.text) // 2:len(a.text) // 2 + 3] for a in alone]
    params = [replace(GREEDY, stop=[s], logprobs=2) for s in stops]
    outs = spec_llm.generate(PROMPTS, params, use_tqdm=False)
    for out, a, stop in zip(outs, alone, stops):
        o = out.outputs[0]
        assert o.text == a.text[:a.text.index(stop)]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert len(o.logprobs) == len(o.token_ids)
        assert o.token_ids == a.token_ids[:len(o.token_ids)]
    # max_tokens exactly, and n > 1 (greedy: every sequence the same)
    outs = spec_llm.generate(PROMPTS[:4], replace(GREEDY, max_tokens=7, n=3), use_tqdm=False)
    for out, a in zip(outs, alone):
        assert [o.token_ids for o in out.outputs] == [a.token_ids[:7]] * 3
    assert_all_blocks_free(spec_llm.engine)
    assert_drafter_empty(spec_llm)


@pytest.mark.parametrize("method", ["ngram", "layerskip"])
def test_preemption_under_speculation_keeps_outputs_exact(alone, method):
    """A drafter's KV is in the sequences' blocks: a preemption frees it with them, and the
    drafter starts that sequence over when it runs again."""
    llm = LLM("smollm2-135m-instruct", num_blocks=13, block_size=16, dtype="float32",
              **METHODS[method])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [a.token_ids for a in alone]
    assert llm.engine.num_preemptions > 0
    assert llm.engine.stats().spec.num_draft_tokens > 0
    assert_all_blocks_free(llm.engine)
    assert_drafter_empty(llm)


def test_seeded_sampling_reproduces_and_ngram_changes_nothing(plain, spec_llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=123,
                            ignore_eos=True)
    prompts = PROMPTS[:3]
    first = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params,
                                                                use_tqdm=False)]
    again = [spec_llm.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    assert first == again
    if spec_llm.engine.proposer.name == "ngram":
        # drafts without a distribution: the same tokens as decoding without speculation
        plain_out = plain.generate(prompts, params, use_tqdm=False)
        assert first == [o.outputs[0].token_ids for o in plain_out]


def test_structured_output_with_speculation(plain):
    llm = LLM("smollm2-135m-instruct", num_blocks=256, dtype="float32", **METHODS["ngram"])
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array",
                                                        "items": {"type": "string"}}},
              "required": ["name", "tags"]}
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputs(json=schema))
    prompts = ["Describe a cat as JSON with a name and tags:",
               "Give a JSON record for the city of Paris, tags tags tags:"]
    expected = [o.outputs[0] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    for g in got:
        if g.finish_reason == "stop":
            assert set(json.loads(g.text)) == {"name", "tags"}
    assert_all_blocks_free(llm.engine)


# ----- the distribution, with a deliberately bad draft --------------------------------------------


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from tests.tiny_models import COMMON, make_hf_model, save_hf_model, write_word_tokenizer

    paths = []
    for name, seed in (("target", 0), ("draft", 1)):
        # qwen3's head size (32) is one the compiled CPU attention takes: 20k samples run fast
        model = make_hf_model("qwen3", seed=seed)
        directory = save_hf_model(model, tmp_path_factory.mktemp(name))
        write_word_tokenizer(directory, COMMON["vocab_size"])
        paths.append(str(directory))
    return paths


def exact_next_distributions(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, ...]:
    """The target's distributions of generated tokens 1, 2 and 3 (2 and 3 marginally, summed
    over every path), computed by batched forwards on an idle engine."""
    from tokenmill.runner.batch import Chunk

    runner = llm.engine.executor.worker

    def next_probs(histories: list[list[int]]) -> torch.Tensor:
        chunks = [Chunk(h, 0, [1 + i]) for i, h in enumerate(histories)]  # one block each
        return runner.forward(chunks).double().softmax(-1)

    p1 = next_probs([prompt])[0]
    vocab = len(p1)
    after1 = next_probs([[*prompt, x] for x in range(vocab)])  # (x1, x2)
    p2 = p1 @ after1
    p3 = torch.zeros(vocab, dtype=torch.float64)
    for x1 in range(vocab):
        after2 = next_probs([[*prompt, x1, x2] for x2 in range(vocab)])  # (x2, x3)
        p3 += p1[x1] * (after1[x1] @ after2)
    return p1, p2, p3


@pytest.mark.slow  # 256 sequences sampled to a distribution
def test_sampled_tokens_follow_the_target_with_a_bad_draft(tiny_pair):
    """20,000 samples of a tiny random target drafted by an unrelated random model: the first
    token (sampled at prefill) and the next two (verified drafts by the rejection rule) are
    distributed as the target's, by a chi-square test against the exact distributions."""
    target, draft = tiny_pair
    # seed: every request samples reproducibly, so the test's verdict does not vary by run
    llm = LLM(target, num_blocks=2048, dtype="float32", max_num_seqs=256, seed=1234,
              speculative_method="draft", speculative_model=draft, num_speculative_tokens=3,
              speculative_adaptive=False)
    prompt = [5, 17, 3, 60, 41, 8, 90, 12]
    p1, p2, p3 = exact_next_distributions(llm, prompt)
    n = 20000
    # max_tokens 4: after the first token, 2 drafts verified (+ the target's own token)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])
    stats = llm.engine.stats().spec
    assert stats.num_draft_tokens > n  # nearly every sequence verified drafts
    assert 0.05 < stats.acceptance_rate < 0.9  # a bad draft: many rejections, some hits
    vocab = len(p1)
    for column, expected in ((0, p1), (1, p2), (2, p3)):
        counts = torch.bincount(tokens[:, column], minlength=vocab)
        assert chi_square_p_value(counts, expected) > 1e-3, column
    assert_all_blocks_free(llm.engine)
    assert_drafter_empty(llm)


def running(manager: KVBlockManager, request: Request) -> Request:
    """A new ``request`` as the scheduler leaves a decoding sequence: KV for all but its last
    token, in blocks of its own."""
    assert manager.allocate_slots(request, request.num_tokens - 1)
    request.num_computed_tokens = request.num_tokens - 1
    return request


def verified(manager: KVBlockManager, drafter: ModelDrafter, request: Request,
             drafts: list[int], new_tokens: list[int]) -> None:
    """A step as the engine runs it: the scheduler allocates for the last token and the
    drafts (finding the drafter's lookahead there), the decoder's observe gives back what the
    step did not use, the update appends the new tokens and trims the rejected drafts."""
    assert manager.allocate_slots(request, 1 + len(drafts))
    request.num_computed_tokens += 1 + len(drafts)
    drafter.end_step()
    request.output_token_ids += new_tokens
    request.num_computed_tokens = request.num_tokens - 1
    manager.trim(request, request.num_computed_tokens)
    manager.check_integrity()
    assert len(manager.block_table(request.request_id)) == \
        cdiv(request.num_computed_tokens, manager.block_size)


def fresh_drafts(loaded, request: Request, k: int) -> list[int]:
    manager = KVBlockManager(32, 4, enable_prefix_caching=False)
    copy = Request(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                   output_token_ids=list(request.output_token_ids))
    drafter = ModelDrafter(loaded.model, loaded.config, manager, device="cpu")
    return drafter.propose([running(manager, copy)], {copy.request_id: k}).token_ids["r"]


def test_drafter_rolls_its_cache_back_to_what_was_accepted(tiny_pair):
    """Drafts after a partial acceptance equal a fresh drafter's: no rejected draft's KV is
    read. The draft KV sits in the sequence's own blocks, grown ahead of the step for the
    drafts and given back after it."""
    from tokenmill.model.loader import load_model

    loaded = load_model(tiny_pair[0], "cpu", "float32")
    manager = KVBlockManager(16, 4, enable_prefix_caching=False)
    drafter = ModelDrafter(loaded.model, loaded.config, manager, device="cpu")
    assert not hasattr(drafter, "free_blocks")
    request = running(manager, Request("r", [5, 17, 3, 60, 41, 8, 90],
                                       SamplingParams(temperature=0.0)))
    first = drafter.propose([request], {"r": 4}).token_ids["r"]
    assert len(first) == 4
    # the lookahead: 7 tokens + 3 drafts written, in the sequence's table, from the pool
    assert len(manager.block_table("r")) == 3 and manager.pool.num_free_blocks == 15 - 3
    # the target kept the first draft, then chose another token than the second
    verified(manager, drafter, request, first, [first[0], (first[1] + 1) % 96])
    again = drafter.propose([request], {"r": 4})
    assert again.token_ids["r"] == fresh_drafts(loaded, request, 4)
    assert again.probs == {"r": [None] * 4}
    # everything accepted and one more token: the cache keeps all of it
    verified(manager, drafter, request, again.token_ids["r"], [*again.token_ids["r"], 7])
    assert drafter.propose([request], {"r": 2}).token_ids["r"] == \
        fresh_drafts(loaded, request, 2)
    drafter.forget(["r"])
    manager.free(request)
    assert manager.pool.num_free_blocks == 15 and not drafter._seqs
    manager.check_integrity()


def test_drafter_leaves_free_what_running_sequences_need(tiny_pair):
    """A lookahead never takes the block another sequence's own next token needs: that
    sequence drafts nothing this step instead, and the scheduler has no one to preempt."""
    from tokenmill.model.loader import load_model

    loaded = load_model(tiny_pair[0], "cpu", "float32")
    manager = KVBlockManager(8, 4, enable_prefix_caching=False)  # 7 usable blocks
    drafter = ModelDrafter(loaded.model, loaded.config, manager, device="cpu")
    long = running(manager, Request("long", list(range(1, 21)), SamplingParams(temperature=0)))
    short = running(manager, Request("short", [1, 2, 3, 4, 5], SamplingParams(temperature=0)))
    assert manager.num_free_blocks == 1  # which short's fifth token needs
    out = drafter.propose([long, short], {"long": 3, "short": 2})
    assert "long" not in out.token_ids and len(out.token_ids["short"]) == 2
    assert len(manager.block_table("long")) == 5 and len(manager.block_table("short")) == 2
    drafter.end_step()  # nothing verified: short's lookahead goes back
    assert len(manager.block_table("short")) == 1 and manager.num_free_blocks == 1
    manager.check_integrity()


def test_the_lookahead_must_fit_the_context(tiny_pair):
    from tokenmill.model.loader import load_model

    loaded = load_model(tiny_pair[0], "cpu", "float32")
    manager = KVBlockManager(64, 4, enable_prefix_caching=False)
    drafter = ModelDrafter(loaded.model, replace(loaded.config, max_position_embeddings=9),
                           manager, device="cpu")
    request = running(manager, Request("r", list(range(1, 8)), SamplingParams(temperature=0)))
    assert len(drafter.propose([request], {"r": 5}).token_ids["r"]) == 2
    assert len(manager.block_table("r")) == 2  # 7 tokens + 1 draft written


class ReferenceDraft:
    """The draft model's greedy token after a history, computed from scratch each time."""

    def __init__(self, loaded) -> None:
        from tokenmill.runner.kv_cache import allocate_kv_cache

        self.model = loaded.model
        self.caches = allocate_kv_cache(loaded.config, 80, 4, "cpu", torch.float32)
        self.memo: dict[tuple[int, ...], int] = {}

    def __call__(self, history: list[int]) -> int:
        from tokenmill.runner.batch import Chunk, build_flat_batch

        key = tuple(history)
        if key not in self.memo:
            table = list(range(1, cdiv(len(key), 4) + 1))
            batch = build_flat_batch([Chunk(list(key), 0, table, num_logits=1)], 4, "cpu")
            with torch.inference_mode():
                logits = self.model(batch.input_ids, batch.positions, self.caches, batch.meta,
                                    batch.logits_indices)
            self.memo[key] = int(logits[0].argmax())
        return self.memo[key]


class CheckedDrafter(ModelDrafter):
    """Every draft must be the draft model's greedy token after the sequence and the drafts
    before it: KV the drafter did not write, or a rejected draft's, would change them."""

    def __init__(self, reference: ReferenceDraft, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reference = reference
        self.num_checked = 0

    def propose(self, requests, num_tokens):
        out = super().propose(requests, num_tokens)
        for r in requests:
            drafts = out.token_ids.get(r.request_id, [])
            history = r.all_token_ids
            for d in drafts:
                assert d == self.reference(history), r.request_id
                history.append(d)
            # written into the sequence's own table, grown ahead of the step
            held = len(self.blocks.block_table(r.request_id)) * self.block_size
            assert not drafts or held >= r.num_tokens + len(drafts) - 1
            self.num_checked += bool(drafts)
        return out


@pytest.mark.parametrize("budget, num_blocks", [(64, 20), (10, 12)])  # (10: drafts cut short)
def test_drafter_kv_lives_in_the_sequences_blocks(tiny_pair, budget, num_blocks):
    """A real draft model proposing for the engine's scheduler (a fake target that agrees with
    it two times in three): through prefix-cache hits, n > 1 forks, rejections and
    preemptions, every draft is the one a fresh computation gives, every step ends with exact
    block tables (``check_integrity``), and every block comes back; block 0 is never written."""
    from tests.test_engine_unit import make_engine
    from tokenmill.model.loader import load_model

    loaded = load_model(tiny_pair[1], "cpu", "float32")
    reference = ReferenceDraft(loaded)

    def target(request: Request, drafts_before) -> int:
        history = [*request.all_token_ids, *drafts_before]
        if len(history) % 3:
            return reference(history)
        return 10 + (history[-1] * 7 + len(history)) % 80

    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    requests = {"a": ([*shared, 40, 41, 42], params), "b": ([*shared, 50, 51, 52], params),
                "c": ([20, 21, 22, 23, 24, 25, 26], replace(params, n=2)),
                "d": ([30, 31, 32, 33, 34], params), "e": ([60, 61, 62, 63, 64, 65], params)}
    engine = make_engine(num_blocks=num_blocks, block_size=4, budget=budget, model=target)
    drafter = CheckedDrafter(reference, loaded.model, loaded.config,
                             engine.scheduler.block_manager, device="cpu")
    engine.proposer = SpeculativeDecoder(drafter, max_k=3, name="draft", adaptive=False,
                                         max_num_batched_tokens=budget)
    # then prompts that find the first ones' blocks in the prefix cache, draft KV and all
    later = {"f": ([*shared, 40, 41, 42, 70], params), "g": ([*shared, 71], params)}
    plain_engine = make_engine(num_blocks=num_blocks, block_size=4, budget=budget, model=target)
    for batch in (requests, later):
        outputs, plain = run(engine, batch), run(plain_engine, batch)
        assert {r: [c.token_ids for c in o.outputs] for r, o in outputs.items()} == \
            {r: [c.token_ids for c in o.outputs] for r, o in plain.items()}
    stats = engine.proposer.stats()
    assert engine.num_preemptions > 0 and drafter.num_checked > 20
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.stats().prefix_cache_hits >= 8 + 8
    assert not drafter._seqs and not drafter._lookahead
    assert all(not k[0].any() and not v[0].any() for k, v in drafter.kv_caches)


def test_a_draft_model_must_share_the_vocabulary(tiny_pair, tmp_path):
    import shutil

    from tests.tiny_models import COMMON, write_word_tokenizer

    target, draft = tiny_pair
    other = tmp_path / "other"
    shutil.copytree(draft, other)
    write_word_tokenizer(other, COMMON["vocab_size"] - 1)  # a different vocabulary
    with pytest.raises(ValueError, match="same vocabulary"):
        LLM(target, num_blocks=64, dtype="float32", speculative_method="draft",
            speculative_model=str(other))
