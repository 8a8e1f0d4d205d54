"""LoRA adapters through the engine: registering and removing them, requests under them, the
scheduler's slots, the prefix cache keyed by adapter, an adapter whose files went away, the
offline API and the ``serve`` flags.

Two kinds of engine: one over a fake runner (no torch, ms) for the bookkeeping, and one over a
tiny random float32 llama with adapters ``peft`` makes in the test (ranks 4/8/16, different
targets), where a request's greedy tokens are compared with the same request run alone.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.fakes import FakeExecutor, run_collecting_failures, word_tokenizer
from tokenmill.cli import build_parser, engine_options
from tokenmill.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import EngineInfo, LLMEngine
from tokenmill.engine.lora_modules import LoRAModule
from tokenmill.errors import LoRAError, LoRALoadError
from tokenmill.params import SamplingParams
from tokenmill.request import LoRARequest, Request
from tokenmill.sched import Scheduler

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# ----- the fake engine: registry and request bookkeeping ----------------------------------------

def fake_model(request: Request, drafts_before: Sequence[int]) -> int:
    """Continues from the last token, shifted by the adapter's id (base: 0)."""
    history = [*request.all_token_ids, *drafts_before]
    shift = request.lora.lora_int_id if request.lora is not None else 0
    return 10 + (history[-1] * 7 + len(history) + 31 * shift) % 180


class LoRAFakeExecutor(FakeExecutor):
    """A fake executor that records adapters loaded and dropped; ``missing`` names adapters
    whose files are gone (a step with them raises ``LoRALoadError``)."""

    def __init__(self) -> None:
        super().__init__(4, fake_model)
        self.loaded: dict[int, str] = {}
        self.missing: set[str] = set()
        self.steps_loras: list[set[str]] = []

    def add_lora(self, lora: LoRARequest) -> str:
        if "bad" in lora.lora_path:
            raise LoRAError(f"LoRA adapter {lora.lora_name!r}: rank 99 > --max-lora-rank 64")
        self.loaded[lora.lora_int_id] = lora.lora_name
        return f"fp-{lora.lora_path}"

    def remove_lora(self, lora_int_id: int) -> None:
        del self.loaded[lora_int_id]

    def execute(self, out, masks=None, draft_probs=None):
        names = {c.request.lora.lora_name for c in out.scheduled if c.request.lora is not None}
        gone = tuple({c.request.lora.lora_int_id for c in out.scheduled
                      if c.request.lora is not None and c.request.lora.lora_name in self.missing})
        if gone:
            raise LoRALoadError("its files are gone", gone)
        self.steps_loras.append(names)
        return super().execute(out, masks, draft_probs)


def fake_engine(max_loras: int | None = 2, lora: bool = True) -> LLMEngine:
    from tokenmill.config import LoRAConfig

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=16,
                                          max_model_len=256),
                          CacheConfig(block_size=4), num_blocks=256, eos_token_ids=[2],
                          max_loras=max_loras if lora else None)
    info = EngineInfo("base", 200, 256, 255 * 4, 16, 4)
    return LLMEngine(scheduler, LoRAFakeExecutor(), word_tokenizer(200), info,
                     lora=LoRAConfig(enable_lora=True, max_loras=max_loras or 4) if lora
                     else None, served_model_name="served")


def test_adapters_are_added_listed_and_removed_with_ids_never_reused():
    engine = fake_engine()
    a = engine.add_lora("a", "/adapters/a")
    b = engine.add_lora("b", "/adapters/b")
    assert (a.lora_int_id, b.lora_int_id) == (1, 2)
    assert a.fingerprint == "fp-/adapters/a" and a.base_model_name == "served"
    assert engine.list_loras() == [a, b]
    engine.remove_lora("a")
    assert engine.list_loras() == [b] and 1 not in engine.executor.loaded
    again = engine.add_lora("a", "/adapters/a")
    assert again.lora_int_id == 3  # a new adapter for the workers, never id 1 again
    assert engine.add_lora("c", "/adapters/c", base_model_name="other").base_model_name == "other"


@pytest.mark.parametrize("name, says", [
    ("a", "already loaded"), ("served", "base model's name"), ("base", "base model's name"),
    ("", "needs a name")])
def test_a_name_in_use_or_the_base_models_is_refused(name, says):
    engine = fake_engine()
    engine.add_lora("a", "/adapters/a")
    with pytest.raises(LoRAError, match=says):
        engine.add_lora(name, "/adapters/x")
    assert [lora.lora_name for lora in engine.list_loras()] == ["a"]


def test_a_bad_adapter_is_refused_with_the_loaders_message_and_nothing_registered():
    engine = fake_engine()
    with pytest.raises(LoRAError, match="rank 99 > --max-lora-rank 64"):
        engine.add_lora("x", "/adapters/bad")
    assert engine.list_loras() == [] and engine.executor.loaded == {}
    with pytest.raises(LoRAError, match="'x' is not loaded"):
        engine.add_request("r", [5, 6], GREEDY, lora_request="x")


def test_unknown_adapters_and_engines_without_lora_refuse_requests():
    engine = fake_engine()
    with pytest.raises(LoRAError, match="'nope' is not loaded"):
        engine.add_request("r", [5, 6], GREEDY, lora_request=LoRARequest("nope", 1, "/x"))
    assert not engine.has_unfinished_requests()
    plain = fake_engine(lora=False)
    with pytest.raises(LoRAError, match="--enable-lora"):
        plain.add_lora("a", "/adapters/a")
    with pytest.raises(LoRAError, match="--enable-lora"):
        plain.add_request("r", [5, 6], GREEDY, lora_request="a")
    assert plain.stats().max_loras == 0 and fake_engine().stats().max_loras == 2


def test_a_replaced_adapters_old_request_object_is_refused():
    engine = fake_engine()
    old = engine.add_lora("a", "/adapters/a")
    engine.remove_lora("a")
    engine.add_lora("a", "/adapters/a2")  # other weights under the same name
    with pytest.raises(LoRAError, match="replaced"):
        engine.add_request("r", [5, 6], GREEDY, lora_request=old)
    engine.add_request("r", [5, 6], GREEDY, lora_request="a")


def test_weights_go_with_the_last_request_of_a_removed_adapter():
    engine = fake_engine()
    a = engine.add_lora("a", "/adapters/a")
    for rid in ("r1", "r2"):
        engine.add_request(rid, [5, 6, 7], GREEDY, lora_request=a)
    engine.add_request("r3", [5, 6, 8], GREEDY, lora_request="a")
    engine.step()
    engine.remove_lora("a")
    with pytest.raises(LoRAError, match="not loaded"):
        engine.add_request("r4", [5, 6], GREEDY, lora_request="a")
    assert engine.list_loras() == [] and a.lora_int_id in engine.executor.loaded
    engine.abort_request("r3")
    finished, failures = run_collecting_failures(engine)
    assert set(finished) == {"r1", "r2"} and not failures
    assert a.lora_int_id not in engine.executor.loaded


def test_a_step_whose_adapter_cannot_load_fails_its_requests_only():
    engine = fake_engine(max_loras=4)
    engine.add_lora("gone", "/adapters/gone")
    engine.add_lora("b", "/adapters/b")
    reference = fake_engine(max_loras=4)
    reference.add_lora("gone", "/adapters/gone")
    reference.add_lora("b", "/adapters/b")
    engine.executor.missing.add("gone")
    for e in (engine, reference):
        e.add_request("x1", [5, 6, 7], GREEDY, lora_request="gone")
        e.add_request("y", [5, 6, 7], GREEDY, lora_request="b")
        e.add_request("z", [5, 6, 7], GREEDY)
        e.add_request("x2", [9, 9], GREEDY, lora_request="gone")
    finished, failures = run_collecting_failures(engine)
    expected, _ = run_collecting_failures(reference)
    assert set(failures) == {"x1", "x2"} and "'gone' could not be loaded" in failures["x1"]
    assert set(finished) == {"y", "z"}
    for rid in ("y", "z"):  # their step ran again without x's chunks, the same tokens
        assert finished[rid].outputs[0].token_ids == expected[rid].outputs[0].token_ids
    assert engine.stats().num_failed_steps == 0


def test_at_most_max_loras_adapters_per_step_and_every_request_completes():
    engine = fake_engine(max_loras=2)
    names = ["a", "b", "c", "d"]
    for name in names:
        engine.add_lora(name, f"/adapters/{name}")
    for i in range(64):
        engine.add_request(f"r{i}", [5 + i % 7, 6], GREEDY, lora_request=names[i % 4])
    finished, failures = run_collecting_failures(engine)
    assert len(finished) == 64 and not failures
    steps = engine.executor.steps_loras
    assert max(map(len, steps)) == 2 and set().union(*steps) == set(names)


def test_stats_carry_the_running_and_waiting_adapters():
    engine = fake_engine(max_loras=1)
    engine.add_lora("a", "/adapters/a")
    engine.add_lora("b", "/adapters/b")
    engine.add_request("r1", [5, 6], GREEDY, lora_request="a")
    engine.add_request("r2", [5, 6], GREEDY, lora_request="b")
    engine.step()
    stats = engine.stats()
    assert (stats.running_loras, stats.waiting_loras, stats.max_loras) == (("a",), ("b",), 1)


def test_the_async_engine_adds_lists_and_removes_adapters_on_its_loop():
    engine = fake_engine()

    async def main():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        a = await async_engine.add_lora("a", "/adapters/a")
        listed = async_engine.loras()
        with pytest.raises(LoRAError, match="already loaded"):
            await async_engine.add_lora("a", "/adapters/a")
        stream = await async_engine.add_request("r", [5, 6], GREEDY, lora_request=a)
        outs = [o async for o in stream]
        await async_engine.remove_lora("a")
        with pytest.raises(LoRAError, match="no LoRA adapter named 'a'"):
            await async_engine.remove_lora("a")
        with pytest.raises(LoRAError, match="not loaded"):
            await async_engine.add_request("r2", [5, 6], GREEDY, lora_request=a)
        after = async_engine.loras()
        await async_engine.shutdown(1)
        return a, listed, outs, after

    a, listed, outs, after = asyncio.run(asyncio.wait_for(main(), 20))
    assert listed == [a] and after == []
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6


# ----- configuration and the command line --------------------------------------------------

@pytest.mark.parametrize("text, module", [
    ("sql=/adapters/sql", LoRAModule("sql", "/adapters/sql")),
    ('{"name": "sql", "path": "/a/sql", "base_model_name": "m"}',
     LoRAModule("sql", "/a/sql", "m")),
    ('{"name": "sql", "path": "/a/sql"}', LoRAModule("sql", "/a/sql")),
])
def test_lora_modules_parse_both_forms(text, module):
    assert LoRAModule.parse(text) == module


@pytest.mark.parametrize("text", ["sql", "=/a", "sql=", '{"name": "sql"}', '{"name": 1}',
                                  '{"name": "a", "path": "/p", "rank": 4}', "{not json"])
def test_bad_lora_modules_are_refused(text):
    with pytest.raises(ValueError, match="--lora-modules"):
        LoRAModule.parse(text)


def test_serve_lora_flags_parse_into_the_config():
    args = build_parser().parse_args(
        ["serve", "m", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}',
         "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16",
         "--allow-runtime-lora"])
    assert args.lora_modules == [LoRAModule("a", "/x/a"), LoRAModule("b", "/x/b")]
    assert args.allow_runtime_lora
    options = engine_options(args)  # the modules imply --enable-lora
    lora = EngineConfig.from_options("m", **options).lora
    assert (lora.enable_lora, lora.max_loras, lora.max_cpu_loras, lora.max_lora_rank) == \
        (True, 2, 3, 16)
    plain = build_parser().parse_args(["serve", "m", "--max-loras", "2"])
    assert not EngineConfig.from_options("m", **engine_options(plain)).lora.enable_lora
    assert build_parser().parse_args(["serve", "m", "--enable-lora"]).enable_lora


def test_lora_with_parallel_ranks_is_refused_at_config_time():
    with pytest.raises(ValueError, match="--enable-lora .* --tensor-parallel-size 2"):
        EngineConfig.from_options(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 2"):
        EngineConfig.from_options(enable_lora=True, pipeline_parallel_size=2)
    EngineConfig.from_options(tensor_parallel_size=2, max_loras=2)  # LoRA off: fine


def test_the_plan_shows_the_lora_settings():
    from tokenmill.engine.plan import make_plan
    from tokenmill.platform import Machine

    config = EngineConfig.from_options(enable_lora=True, max_loras=3, max_lora_rank=32)
    plan = make_plan(config, Machine.described("avx2"))
    assert plan.describe()["lora"] == {"max_loras": 3, "max_cpu_loras": 16, "max_lora_rank": 32}
    assert plan.worker_spec().lora == config.lora
    assert make_plan(EngineConfig(), Machine.described("avx2")).describe()["lora"] == "off"


# ----- a tiny float32 llama with peft adapters -------------------------------------------------

SIZES = dict(hidden_size=128, intermediate_size=96)  # 4 heads of 32: the CPU kernels take it
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a": (4, ["q_proj", "v_proj"]), "b": (8, ALL),
            "c": (16, ["gate_proj", "up_proj", "down_proj"]), "d": (8, ["k_proj", "o_proj"])}
BASE = dict(dtype="float32", block_size=4, num_blocks=160, max_model_len=128, enable_lora=True)
PROMPT = [11, 42, 7, 93, 5, 18, 60, 3, 77, 31, 8, 64, 25]  # 13 tokens: 3 full blocks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from tests.tiny_models import COMMON, make_hf_model, save_hf_model, write_word_tokenizer

    directory = tmp_path_factory.mktemp("lora_base")
    save_hf_model(make_hf_model("llama", seed=3, **SIZES), directory)
    write_word_tokenizer(directory, COMMON["vocab_size"])
    return directory


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    """name -> the directory of a PEFT adapter of the tiny model (random A and B)."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.tiny_models import make_hf_model

    paths = {}
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        model = get_peft_model(make_hf_model("llama", seed=3, **SIZES), LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False))
        directory = tmp_path_factory.mktemp(f"lora_{name}")
        model.save_pretrained(directory)
        paths[name] = str(directory)
    return paths


def tiny_engine(model: Path, adapters: dict[str, str], names: Sequence[str] = (),
                **options) -> LLMEngine:
    engine = LLMEngine.from_config(EngineConfig.from_options(str(model), **{**BASE, **options}))
    for name in names:
        engine.add_lora(name, adapters[name])
    return engine


def generate(engine: LLMEngine, requests: Sequence[tuple[str, list[int], str | None]],
             params: SamplingParams = GREEDY) -> tuple[dict, dict]:
    for rid, prompt, lora in requests:
        engine.add_request(rid, prompt, params, lora_request=lora)
    return run_collecting_failures(engine)


@pytest.fixture(scope="module")
def alone(tiny, adapters):
    """(prompt, adapter or None) -> its greedy tokens, the request run by itself."""
    engine = tiny_engine(tiny, adapters, list(ADAPTERS), enable_prefix_caching=False)
    cache: dict[tuple, list[int]] = {}

    def tokens(prompt: list[int], name: str | None) -> list[int]:
        key = (tuple(prompt), name)
        if key not in cache:
            done, failures = generate(engine, [("r", prompt, name)])
            assert not failures
            cache[key] = list(done["r"].outputs[0].token_ids)
        return cache[key]

    yield tokens
    engine.shutdown()


@pytest.mark.parametrize("eager", [False, True], ids=["as-planned", "eager"])
def test_a_batch_of_base_and_three_adapters_equals_each_alone(tiny, adapters, alone, eager):
    # as planned: the fused CPU step where the kernels build; eager: layer by layer
    engine = tiny_engine(tiny, adapters, ["a", "b", "c"], max_loras=4, enforce_eager=eager)
    assert engine.info.cpu_step.startswith("eager") or not eager
    names = [None, "a", "b", "c"]
    done, failures = generate(engine, [(f"r{i}", PROMPT, n) for i, n in enumerate(names)])
    assert not failures
    base = alone(PROMPT, None)
    for i, name in enumerate(names):
        assert done[f"r{i}"].outputs[0].token_ids == alone(PROMPT, name), name
        if name is not None:
            assert alone(PROMPT, name) != base, f"adapter {name} changes nothing"
        assert done[f"r{i}"].num_cached_tokens == 0  # one prompt, four namespaces


def test_prefixes_hit_within_one_adapter_never_across(tiny, adapters, alone):
    engine = tiny_engine(tiny, adapters, ["a", "b"])
    cached = {}
    for rid, name in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("base1", None), ("base2", None)]:
        done, _ = generate(engine, [(rid, PROMPT, name)])
        cached[rid] = done[rid].num_cached_tokens
        assert done[rid].outputs[0].token_ids == alone(PROMPT, name)
    assert cached == {"a1": 0, "a2": 12, "b1": 0, "base1": 0, "base2": 12}
    engine.remove_lora("a")
    engine.add_lora("a", adapters["a"])  # the same files again: the same fingerprint
    assert generate(engine, [("a3", PROMPT, "a")])[0]["a3"].num_cached_tokens == 12
    engine.remove_lora("a")
    engine.add_lora("a", adapters["d"])  # other weights under the name: nothing to reuse
    done, _ = generate(engine, [("a4", PROMPT, "a")])
    assert done["a4"].num_cached_tokens == 0
    assert done["a4"].outputs[0].token_ids == alone(PROMPT, "d")


def test_two_slots_serve_sixty_four_requests_of_four_adapters(tiny, adapters, alone):
    engine = tiny_engine(tiny, adapters, list(ADAPTERS), max_loras=2, max_num_seqs=64,
                         num_blocks=256)
    per_step: list[set[str]] = []
    execute = engine.executor.execute

    def spy(out, *args, **kwargs):
        per_step.append({c.request.lora.lora_name for c in out.scheduled if c.request.lora})
        return execute(out, *args, **kwargs)

    engine.executor.execute = spy
    prompts = [PROMPT[i:i + 6] for i in range(4)]
    names = list(ADAPTERS)
    requests = [(f"r{i}", prompts[i // 16], names[i % 4]) for i in range(64)]
    done, failures = generate(engine, requests,
                              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(done) == 64 and not failures
    assert max(map(len, per_step)) == 2 and set().union(*per_step) == set(names)
    for rid, prompt, name in requests:
        assert done[rid].outputs[0].token_ids == alone(prompt, name)[:3], rid


def test_unloading_waits_for_the_requests_in_flight(tiny, adapters, alone):
    engine = tiny_engine(tiny, adapters, ["a", "b"])
    manager = engine.executor.worker.lora
    a = engine.list_loras()[0]
    for rid in ("r1", "r2"):
        engine.add_request(rid, PROMPT, GREEDY, lora_request="a")
    engine.step()
    engine.remove_lora("a")
    with pytest.raises(LoRAError, match="not loaded"):
        engine.add_request("r3", PROMPT, GREEDY, lora_request="a")
    assert a.lora_int_id in manager.loaded_ids()  # its requests still run under it
    done, failures = run_collecting_failures(engine)
    assert not failures and all(done[r].outputs[0].token_ids == alone(PROMPT, "a")
                                for r in ("r1", "r2"))
    assert a.lora_int_id not in manager.loaded_ids()
    assert [lora.lora_name for lora in engine.list_loras()] == ["b"]


def test_an_evicted_adapter_whose_files_went_away_fails_only_its_requests(
        tiny, adapters, alone, tmp_path):
    copy = shutil.copytree(adapters["a"], tmp_path / "a")
    engine = tiny_engine(tiny, adapters, max_loras=1, max_cpu_loras=1)
    engine.add_lora("gone", str(copy))
    engine.add_lora("b", adapters["b"])  # one adapter kept in memory: "gone" is evicted
    shutil.rmtree(copy)
    done, failures = generate(engine, [("x", PROMPT, "gone"), ("y", PROMPT, "b"),
                                       ("z", PROMPT, None)])
    assert set(failures) == {"x"} and "'gone' could not be" in failures["x"]
    assert done["y"].outputs[0].token_ids == alone(PROMPT, "b")
    assert done["z"].outputs[0].token_ids == alone(PROMPT, None)


def test_an_adapter_that_does_not_fit_is_refused_with_its_reason(tiny, adapters):
    engine = tiny_engine(tiny, adapters, max_lora_rank=8)
    with pytest.raises(LoRAError, match="rank"):
        engine.add_lora("c", adapters["c"])  # rank 16
    with pytest.raises(LoRAError):
        engine.add_lora("nowhere", str(Path(adapters["c"]) / "missing"))
    assert engine.list_loras() == []
    assert engine.add_lora("a", adapters["a"]).lora_int_id == 3  # ids of failed loads are spent


def test_layer_skip_drafts_leave_lora_output_unchanged(tiny, adapters, alone):
    engine = tiny_engine(tiny, adapters, ["b"], speculative_method="layerskip",
                         speculative_draft_layers=1, num_speculative_tokens=3)
    done, failures = generate(engine, [("r", PROMPT, "b"), ("s", PROMPT, None)])
    assert not failures and engine.stats().num_draft_tokens > 0
    assert done["r"].outputs[0].token_ids == alone(PROMPT, "b")
    assert done["s"].outputs[0].token_ids == alone(PROMPT, None)


def test_llm_generate_with_lora_request(tiny, adapters, alone):
    from tokenmill import LLM
    from tokenmill import LoRARequest as Exported

    llm = LLM(str(tiny), **BASE)
    a = llm.add_lora("a", adapters["a"])
    outs = llm.generate([PROMPT, PROMPT], GREEDY, use_tqdm=False, lora_request=[a, None])
    assert [o.outputs[0].token_ids for o in outs] == [alone(PROMPT, "a"), alone(PROMPT, None)]
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False, lora="a")[0]
    assert out.outputs[0].token_ids == alone(PROMPT, "a")
    # vLLM's habit: a LoRARequest the engine has not seen is loaded from its path
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False,
                       lora_request=Exported("c", 7, adapters["c"]))[0]
    assert out.outputs[0].token_ids == alone(PROMPT, "c")
    assert [lora.lora_name for lora in llm.list_loras()] == ["a", "c"]
    with pytest.raises(TypeError, match="not both"):
        llm.generate(PROMPT, GREEDY, lora_request="a", lora="a")


def test_serve_stops_on_a_bad_lora_module_with_one_line(tiny, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", str(tiny),
                          "--dtype", "float32", "--kv-cache-memory", "64blocks", "--port", "0",
                          "--lora-modules", f"broken={tmp_path / 'nothing'}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenmill: error: ") and "nothing" in last, out.stderr
    assert "Traceback" not in out.stderr
