"""LoRA adapters: PEFT's files read into tokenmill's fused per-layer weights (checked against
PEFT's own merged weights), every adapter that does not fit refused with a message naming why,
the runner's residency (LRU of loaded adapters, slots, reloading evicted ones), and a tiny
float32 model serving base + 3 adapters in one batch against PEFT-merged transformers models.

Adapters are made here with ``peft`` on tiny random models (``init_lora_weights=False``, so B
is not zero and every adapter changes the output)."""

from __future__ import annotations

import copy
import importlib.util
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.tiny_models import make_hf_model, save_hf_model
from tokenmill.config import LoRAConfig
from tokenmill.errors import LoRAError, LoRALoadError
from tokenmill.model.hf_files import hf_model_config
from tokenmill.model.lora.peft import PEFT_MODULES, adapter_fingerprint, module_key
from tokenmill.model.lora.peft import read_peft_adapter
from tokenmill.request import LoRARequest
from tokenmill.runner.batch import Chunk

# peft is imported where it is used: importing it loads Triton, which must not happen while tests
# are collected (conftest.py)
if importlib.util.find_spec("peft") is None:
    pytest.skip("peft is not installed", allow_module_level=True)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL = ATTENTION + MLP
ROLES = {role: [n for n, (_, r, _) in PEFT_MODULES.items() if r == role]
         for role in ("qkv", "o", "gate_up", "down")}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(transformers model, its directory, its ModelConfig): a tiny Llama with 2 KV heads."""
    hf = make_hf_model("llama")
    path = save_hf_model(hf, tmp_path_factory.mktemp("base"))
    return hf, path, hf_model_config(path)


def make_adapter(hf, directory: Path, seed: int = 1, safe: bool = True, **lora):
    """A PEFT adapter of ``hf`` saved to ``directory``; the PEFT model (weights random)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, **lora))
    peft_model.save_pretrained(directory, safe_serialization=safe)
    return peft_model


def peft_deltas(hf, peft_model) -> dict[str, torch.Tensor]:
    """Per module (its Hugging Face name), what PEFT's merge adds to its weight."""
    merged = dict(peft_model.merge_and_unload().named_parameters())
    return {name: merged[name].detach() - p.detach() for name, p in hf.named_parameters()}


def assert_matches_merge(adapter, deltas: dict[str, torch.Tensor], num_layers: int) -> None:
    """Each fused linear's ``b.T @ a`` equals PEFT's merged deltas of its modules, stacked in
    tokenmill's output order (zero where the adapter has no LoRA)."""
    for layer in range(num_layers):
        for role, names in ROLES.items():
            expected = torch.cat([deltas[module_key(layer, n) + ".weight"] for n in names])
            m = adapter.weights.get((layer, role))
            got = torch.zeros_like(expected) if m is None else m.b.float().T @ m.a.float()
            torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5,
                                       msg=f"layer {layer} {role}")


READ_CASES = {
    "r4-attention": dict(r=4, lora_alpha=8, target_modules=ATTENTION),
    "r8-mlp": dict(r=8, lora_alpha=16, target_modules=MLP),
    "r16-all-rslora": dict(r=16, lora_alpha=8, target_modules=ALL, use_rslora=True),
    "patterns": dict(r=8, lora_alpha=16, target_modules=ALL,
                     rank_pattern={"k_proj": 4, "layers.1.mlp.down_proj": 2},
                     alpha_pattern={"v_proj": 32, "gate_proj": 4}),
    "layers-to-transform": dict(r=4, lora_alpha=4, target_modules=["q_proj", "v_proj", "up_proj"],
                                layers_to_transform=[1]),
    "regex-targets": dict(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|up_proj|o_proj)"),
}


@pytest.mark.parametrize("case", sorted(READ_CASES))
def test_read_matches_peft_merge(base, tmp_path, case):
    hf, _, cfg = base
    peft_model = make_adapter(hf, tmp_path, **READ_CASES[case])
    adapter = read_peft_adapter(tmp_path, cfg, torch.float32, max_rank=16)
    assert_matches_merge(adapter, peft_deltas(hf, peft_model), cfg.num_layers)
    lora = READ_CASES[case]
    assert adapter.rank == lora["r"]
    assert adapter.alpha == lora["lora_alpha"]
    for m in adapter.weights.values():
        assert m.a.dtype == m.b.dtype == torch.float32 and m.a.is_contiguous()


def test_slices_have_their_own_ranks_and_offsets(base, tmp_path):
    hf, _, cfg = base
    make_adapter(hf, tmp_path, r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                 rank_pattern={"v_proj": 2})
    adapter = read_peft_adapter(tmp_path, cfg, torch.float32, max_rank=8)
    qkv = adapter.weights[0, "qkv"]
    assert [(s.rank_start, s.rank, s.out_start, s.out_size) for s in qkv.slices] == \
        [(0, 8, 0, cfg.q_size), (8, 2, cfg.q_size + cfg.kv_size, cfg.kv_size)]
    assert qkv.a.shape == (10, cfg.hidden_size)
    assert qkv.b.shape == (10, cfg.q_size + 2 * cfg.kv_size)
    up = adapter.weights[1, "gate_up"].slices
    assert [(s.rank, s.out_start) for s in up] == [(8, cfg.intermediate_size)]
    assert adapter.targets == ("q_proj", "v_proj", "up_proj")
    assert (0, "o") not in adapter.weights


def test_bfloat16_and_bin_and_adapter_name_infix(base, tmp_path):
    """adapter_model.bin reads like the safetensors file; a ``.default`` infix in the keys
    (some PEFT versions) is tolerated; the weights come in the compute dtype."""
    from safetensors.torch import load_file, save_file

    hf, _, cfg = base
    lora = dict(r=4, lora_alpha=8, target_modules=ALL)
    make_adapter(hf, tmp_path / "st", **lora)
    make_adapter(hf, tmp_path / "bin", safe=False, **lora)
    assert not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    reference = read_peft_adapter(tmp_path / "st", cfg, torch.float32, 16)
    from_bin = read_peft_adapter(tmp_path / "bin", cfg, torch.float32, 16)
    tensors = load_file(tmp_path / "st" / "adapter_model.safetensors")
    save_file({k.replace(".weight", ".default.weight"): v for k, v in tensors.items()},
              tmp_path / "st" / "adapter_model.safetensors")
    infix = read_peft_adapter(tmp_path / "st", cfg, torch.bfloat16, 16)
    for key, m in reference.weights.items():
        assert torch.equal(from_bin.weights[key].b, m.b)
        assert infix.weights[key].b.dtype == torch.bfloat16
        torch.testing.assert_close(infix.weights[key].b.float(), m.b, atol=0.02, rtol=0.01)


def test_fingerprint_follows_the_files(base, tmp_path):
    hf, _, cfg = base
    make_adapter(hf, tmp_path / "a", r=4, target_modules=["q_proj"])
    make_adapter(hf, tmp_path / "b", seed=2, r=4, target_modules=["q_proj"])
    a = read_peft_adapter(tmp_path / "a", cfg, torch.float32, 8)
    assert a.fingerprint == adapter_fingerprint(tmp_path / "a")
    assert len(a.fingerprint) == 16
    assert a.fingerprint != adapter_fingerprint(tmp_path / "b")
    assert a.nbytes() == sum(m.a.nbytes + m.b.nbytes for m in a.weights.values())


# ---- refusals -------------------------------------------------------------------------------

def _edit_config(directory: Path, **changes) -> None:
    path = directory / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _edit_weights(directory: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _q_key(layer: int, ab: str) -> str:
    return f"base_model.model.{module_key(layer, 'q_proj')}.lora_{ab}.weight"


def _drop_b(t):
    del t[_q_key(0, "B")]


def _narrow_b(t):
    t[_q_key(0, "B")] = t[_q_key(0, "B")][:32].contiguous()


def _wide_a(t):
    t[_q_key(0, "A")] = torch.zeros(4, 100)


def _three_d(t):
    t[_q_key(0, "A")] = t[_q_key(0, "A")].unsqueeze(0)


def _lm_head_weight(t):
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(4, 64)


def _dora_magnitude(t):
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = torch.ones(64)


def _far_layer(t):
    t[_q_key(7, "A")], t[_q_key(7, "B")] = t[_q_key(0, "A")].clone(), t[_q_key(0, "B")].clone()


REFUSED_CONFIGS = {
    "rank": (dict(r=16), "rank 16 exceeds --max-lora-rank 8"),
    "rank-pattern": (dict(rank_pattern={"q_proj": 32}), "rank 32 exceeds --max-lora-rank 8"),
    "lm_head": (dict(target_modules=["q_proj", "lm_head"]), "'lm_head' cannot be adapted"),
    "embed_tokens": (dict(target_modules=["embed_tokens"]), "'embed_tokens' cannot be adapted"),
    "unknown": (dict(target_modules=["q_proj", "foo_proj"]), "'foo_proj' cannot be adapted"),
    "regex-lm_head": (dict(target_modules=r".*(q_proj|lm_head)"), "selects lm_head"),
    "dora": (dict(use_dora=True), "DoRA"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    "fan_in_fan_out": (dict(fan_in_fan_out=True), "fan_in_fan_out"),
    "bias": (dict(bias="all"), "bias='all'"),
    "peft_type": (dict(peft_type="IA3"), "peft_type is 'IA3'"),
    "layers_pattern": (dict(layers_to_transform=[0], layers_pattern="h"), "layers_pattern 'h'"),
    "r-vs-tensors": (dict(r=2), "gives it rank 2"),
    "untargeted-weights": (dict(target_modules=["o_proj"]), "has weights for layer 0 q_proj"),
    "targeted-but-absent": (dict(target_modules=["q_proj", "k_proj"]),
                            "lacks lora_A / lora_B of layer 0 k_proj"),
    "no-r": (dict(r=None), "not a number"),
    "bad-regex": (dict(rank_pattern={"q_proj(": 2}), "not a valid regex"),
}

REFUSED_WEIGHTS = {
    "missing-b": (_drop_b, "layer 0 q_proj has lora_A but no lora_B"),
    "shape-out": (_narrow_b, "layer 0 q_proj lora_B is (32, 4); the base model's q_proj has "
                             "64 outputs"),
    "shape-in": (_wide_a, "layer 0 q_proj lora_A is (4, 100); the base model's q_proj has "
                          "64 inputs"),
    "not-a-matrix": (_three_d, "layer 0 q_proj lora_A is a 3-D"),
    "lm_head-weights": (_lm_head_weight, "'lm_head' cannot be adapted"),
    "dora-weights": (_dora_magnitude, "lora_magnitude_vector"),
    "layer-beyond": (_far_layer, "layer 7 q_proj: the base model has 2 layers"),
}


@pytest.fixture(scope="module")
def good_adapter(base, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good")
    make_adapter(base[0], path, r=4, lora_alpha=8, target_modules=["q_proj"])
    return path


def _copy_adapter(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("case", sorted(REFUSED_CONFIGS))
def test_refused_config(base, good_adapter, tmp_path, case):
    changes, message = REFUSED_CONFIGS[case]
    path = _copy_adapter(good_adapter, tmp_path / "a")
    _edit_config(path, **changes)
    with pytest.raises(LoRAError, match=_literal(message)) as e:
        read_peft_adapter(path, base[2], torch.float32, max_rank=8)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("case", sorted(REFUSED_WEIGHTS))
def test_refused_weights(base, good_adapter, tmp_path, case):
    edit, message = REFUSED_WEIGHTS[case]
    path = _copy_adapter(good_adapter, tmp_path / "a")
    _edit_weights(path, edit)
    with pytest.raises(LoRAError, match=_literal(message)):
        read_peft_adapter(path, base[2], torch.float32, max_rank=8)


def _literal(text: str) -> str:
    import re

    return re.escape(text)


def test_refused_files(base, good_adapter, tmp_path):
    cfg = base[2]
    with pytest.raises(LoRAError, match="no such directory"):
        read_peft_adapter(tmp_path / "nowhere", cfg, torch.float32, 8)
    no_weights = _copy_adapter(good_adapter, tmp_path / "w")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAError, match="adapter_model.safetensors is missing"):
        read_peft_adapter(no_weights, cfg, torch.float32, 8)
    no_config = _copy_adapter(good_adapter, tmp_path / "c")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match="adapter_config.json is missing"):
        read_peft_adapter(no_config, cfg, torch.float32, 8)
    bad_json = _copy_adapter(good_adapter, tmp_path / "j")
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="adapter_config.json is not valid JSON"):
        read_peft_adapter(bad_json, cfg, torch.float32, 8)
    bad_bin = _copy_adapter(good_adapter, tmp_path / "b")
    (bad_bin / "adapter_model.safetensors").unlink()
    torch.save({"x": SimpleNamespace(a=1)}, bad_bin / "adapter_model.bin")
    with pytest.raises(LoRAError, match="adapter_model.bin cannot be loaded as plain tensors"):
        read_peft_adapter(bad_bin, cfg, torch.float32, 8)
    broken = _copy_adapter(good_adapter, tmp_path / "s")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(LoRAError, match="not a readable safetensors file"):
        read_peft_adapter(broken, cfg, torch.float32, 8)


def test_shapes_from_another_model_refused(base, tmp_path):
    """An adapter trained on a model of another shape names the module and both shapes."""
    other = make_hf_model("llama", intermediate_size=128)
    make_adapter(other, tmp_path, r=4, target_modules=["down_proj"])
    with pytest.raises(LoRAError, match=_literal(
            "layer 0 down_proj lora_A is (4, 128); the base model's down_proj has 96 inputs")):
        read_peft_adapter(tmp_path, base[2], torch.float32, 8)


# ---- residency: LoRAManager over recording slots ----------------------------------------------

@dataclass
class RecordingSlots:
    """Stands in for ``LoRASlots``: what was installed where, and each step's groups."""

    model: object
    max_loras: int
    ops: object = None
    installed: dict[int, dict] = field(default_factory=dict)
    steps: list[list[tuple[int, list[int]]]] = field(default_factory=list)
    in_step: bool = False

    def set_slot(self, slot: int, weights) -> None:
        assert 0 <= slot < self.max_loras
        self.installed[slot] = weights

    def clear_slot(self, slot: int) -> None:
        assert 0 <= slot < self.max_loras
        self.installed.pop(slot, None)

    def set_step(self, groups) -> None:
        slots = [s for s, _ in groups]
        assert len(set(slots)) == len(slots) and all(s in self.installed for s in slots)
        self.steps.append([(s, rows.tolist()) for s, rows in groups])
        self.in_step = True

    def clear_step(self) -> None:
        self.in_step = False

    def nbytes(self) -> int:
        return sum(m.nbytes() for w in self.installed.values() for m in w.values())


@pytest.fixture(scope="module")
def four_adapters(base, tmp_path_factory) -> list[Path]:
    paths = []
    for i, targets in enumerate([ATTENTION, MLP, ["q_proj", "down_proj"], ALL]):
        path = tmp_path_factory.mktemp(f"adapter{i}")
        make_adapter(base[0], path, seed=10 + i, r=4 * (i % 2 + 1), target_modules=targets)
        paths.append(path)
    return paths


def manager(base, monkeypatch, max_loras: int, max_cpu_loras: int):
    import tokenmill.runner.lora as lora_module

    monkeypatch.setattr(lora_module, "LoRASlots", RecordingSlots)
    config = LoRAConfig(enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                        max_lora_rank=16)
    return lora_module.LoRAManager(None, config, base[2], torch.float32, None)


def _requests(paths) -> list[LoRARequest]:
    return [LoRARequest(f"ad{i}", i + 1, str(p)) for i, p in enumerate(paths)]


def _chunk(n: int, lora: LoRARequest | None) -> SimpleNamespace:
    return SimpleNamespace(token_ids=[1] * n, request=SimpleNamespace(lora=lora))


def _step(m, loras: list[LoRARequest | None], sizes: list[int] | None = None):
    sizes = sizes or [1] * len(loras)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    try:
        return m.prepare([_chunk(n, lo) for n, lo in zip(sizes, loras)], starts)
    finally:
        m.finish()


def test_groups_rows_by_adapter(base, four_adapters, monkeypatch):
    m = manager(base, monkeypatch, 2, 4)
    a, b, _, _ = _requests(four_adapters)
    assert m.add(a) == adapter_fingerprint(four_adapters[0])
    m.add(b)
    assert _step(m, [None, None]) is False
    assert m.slots.steps[-1] == []
    assert _step(m, [a, None, b, a], [3, 2, 1, 2]) is True
    groups = dict((s, rows) for s, rows in m.slots.steps[-1])
    slot_a, slot_b = m.slot_ids()[a.lora_int_id], m.slot_ids()[b.lora_int_id]
    assert groups == {slot_a: [0, 1, 2, 6, 7], slot_b: [5]}
    assert m.slots.installed[slot_a] is m._loaded[a.lora_int_id].weights
    assert not m.slots.in_step  # finish cleared the step
    # plain Chunks (tests, greedy_generate) run the base model
    assert m.prepare([Chunk([1, 2], 0, [1])], [0, 2]) is False


def test_lru_eviction_and_reload(base, four_adapters, monkeypatch, tmp_path):
    m = manager(base, monkeypatch, 1, 2)
    loras = _requests(four_adapters[:3])
    for lora in loras:
        m.add(lora)
    assert m.loaded_ids() == [2, 3]  # the first one was evicted
    _step(m, [loras[0]])
    assert m.loaded_ids() == [3, 1]  # read again; the least recently used went
    assert m.slot_ids() == {1: 0}
    _step(m, [loras[1]])
    assert m.loaded_ids() == [1, 2] and m.slot_ids() == {2: 0}
    described = m.describe()
    assert described["loaded"] == ["ad0", "ad1"] and described["slots"] == {0: "ad1"}
    assert described["registered"] == ["ad0", "ad1", "ad2"]


def test_slots_never_exceed_max_loras(base, four_adapters, monkeypatch):
    m = manager(base, monkeypatch, 2, 3)
    loras = _requests(four_adapters)
    for lora in loras:
        m.add(lora)
    rng = random.Random(0)
    for _ in range(40):
        chosen = rng.sample(loras, rng.randint(1, 2))
        batch = [rng.choice([*chosen, None]) for _ in range(5)] + chosen
        _step(m, batch)
        assert len(m.slot_ids()) <= 2 and len(m.loaded_ids()) <= 3
        slots = m.slot_ids()
        for s, _ in m.slots.steps[-1]:
            owner = next(i for i, slot in slots.items() if slot == s)
            assert m.slots.installed[s] is m._loaded[owner].weights
        assert {slots[lo.lora_int_id] for lo in chosen} == {s for s, _ in m.slots.steps[-1]}


def test_an_adapter_keeps_its_slot_while_used(base, four_adapters, monkeypatch):
    m = manager(base, monkeypatch, 2, 4)
    a, b, c, _ = _requests(four_adapters)
    for lora in (a, b, c):
        m.add(lora)
    _step(m, [a, b])
    slot_a = m.slot_ids()[1]
    _step(m, [a])
    _step(m, [a, c])  # b, used longest ago, gives its slot up; a keeps its own
    assert m.slot_ids() == {1: slot_a, 3: 1 - slot_a}


def test_a_step_loads_an_adapter_never_added(base, four_adapters, monkeypatch, tmp_path):
    m = manager(base, monkeypatch, 2, 2)
    a = _requests(four_adapters[:1])[0]
    assert _step(m, [a]) is True
    assert m.loaded_ids() == [a.lora_int_id] and m.describe()["registered"] == ["ad0"]
    missing = LoRARequest("missing", 5, str(tmp_path / "nowhere"))
    with pytest.raises(LoRALoadError, match="'missing' could not be reloaded"):
        _step(m, [missing])
    assert m.describe()["registered"] == ["ad0"]


def test_too_many_adapters_in_one_step(base, four_adapters, monkeypatch):
    m = manager(base, monkeypatch, 2, 4)
    loras = _requests(four_adapters[:3])
    for lora in loras:
        m.add(lora)
    with pytest.raises(RuntimeError, match="3 LoRA adapters .* --max-loras 2"):
        _step(m, loras)
    assert not m.slots.in_step


def test_reload_failure_names_the_adapter(base, four_adapters, monkeypatch, tmp_path):
    m = manager(base, monkeypatch, 1, 1)
    gone = _copy_adapter(four_adapters[0], tmp_path / "gone")
    a = LoRARequest("gone", 7, str(gone))
    b = LoRARequest("other", 8, str(four_adapters[1]))
    m.add(a)
    m.add(b)  # evicts a
    (gone / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRALoadError, match="'gone' could not be reloaded.*missing") as e:
        _step(m, [a, None])
    assert e.value.lora_ids == (7,)
    _step(m, [b])  # the others go on


def test_changed_files_are_not_reloaded(base, four_adapters, monkeypatch, tmp_path):
    """An evicted adapter whose files changed is refused: its prefix-cache entries were keyed
    by the old weights' fingerprint."""
    m = manager(base, monkeypatch, 1, 1)
    path = _copy_adapter(four_adapters[0], tmp_path / "x")
    a = LoRARequest("x", 1, str(path))
    m.add(a)
    m.add(LoRARequest("other", 2, str(four_adapters[1])))
    _copy_adapter(four_adapters[2], tmp_path / "y")
    for f in (tmp_path / "y").iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(LoRALoadError, match="changed since it was added"):
        _step(m, [a])


def test_add_refuses_and_remove_forgets(base, four_adapters, monkeypatch, tmp_path):
    m = manager(base, monkeypatch, 2, 2)
    bad = _copy_adapter(four_adapters[0], tmp_path / "bad")
    _edit_config(bad, r=32)
    with pytest.raises(LoRAError, match="rank 32 exceeds --max-lora-rank 16"):
        m.add(LoRARequest("bad", 1, str(bad)))
    assert m.describe()["registered"] == []
    a = _requests(four_adapters[:1])[0]
    m.add(a)
    _step(m, [a])
    m.remove(a.lora_int_id)
    assert m.loaded_ids() == [] and m.slot_ids() == {} and m.slots.installed == {}
    m.remove(99)  # unknown: nothing


# ---- the runner around a forward ----------------------------------------------------------

class RecordingManager:
    def __init__(self, fail: bool = False):
        self.calls: list[tuple] = []
        self.fail = fail

    def prepare(self, chunks, query_start) -> bool:
        self.calls.append(("prepare", list(query_start)))
        if self.fail:
            raise LoRALoadError("gone", (1,))
        return any(getattr(getattr(c, "request", None), "lora", None) for c in chunks)

    def finish(self) -> None:
        self.calls.append(("finish",))


class NoGraphs:
    def run(self, chunks):
        raise AssertionError("a step with LoRA rows must not replay CUDA graphs")


def test_runner_prepares_and_finishes_every_forward(base):
    from tokenmill.model.loader import load_model
    from tokenmill.runner.model_runner import ModelRunner

    runner = ModelRunner(load_model(str(base[1]), "cpu"), num_blocks=8, block_size=4)
    runner.lora = RecordingManager()
    runner.graphs = NoGraphs()
    lora = LoRARequest("x", 1, "/nowhere")
    chunks = [_runner_chunk([1, 2, 3], [1], None), _runner_chunk([4, 5], [2], lora)]
    assert runner.forward(chunks).shape == (2, base[2].vocab_size)
    assert runner.lora.calls == [("prepare", [0, 3, 5]), ("finish",)]
    runner.lora = RecordingManager(fail=True)
    with pytest.raises(LoRALoadError):
        runner.forward(chunks)
    assert runner.lora.calls[-1] == ("finish",)


def _runner_chunk(tokens, table, lora):
    chunk = Chunk(tokens, 0, table)
    chunk.request = SimpleNamespace(lora=lora)
    return chunk


# ---- end to end: base + 3 adapters in one batch against PEFT-merged transformers models ------

E2E_ADAPTERS = [
    dict(r=4, lora_alpha=8, target_modules=ATTENTION),
    dict(r=8, lora_alpha=16, target_modules=MLP),
    dict(r=16, lora_alpha=16, target_modules=ALL, use_rslora=True, rank_pattern={"k_proj": 4}),
]
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 3, 81, 12], [8, 90, 1, 44, 23, 19, 70, 2, 6],
           [30, 31, 32]]
E2E_BLOCK = 16
NEW_TOKENS = 6
E2E_TOL = 1e-4


def _f32_step_built() -> bool:
    from tokenmill.kernels import cpu

    ops = cpu.load()
    return ops is not None and getattr(ops, "f32_pack_cols", 0) > 0


@dataclass
class LoRAChunk(Chunk):
    """A plain chunk with the request a scheduled one carries (only its ``lora`` is read)."""

    request: object = None


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    """The base directory (4 heads of 32: the fused CPU step's smallest head), and per
    sequence of PROMPTS its LoRARequest (None: base) and the reference: transformers' base
    model or PEFT's merge_and_unload() of that adapter."""
    hf = make_hf_model("llama", seed=3, hidden_size=128, intermediate_size=96)
    path = save_hf_model(hf, tmp_path_factory.mktemp("e2e-base"))
    loras, refs = [None], [hf]
    for i, spec in enumerate(E2E_ADAPTERS):
        directory = tmp_path_factory.mktemp(f"e2e{i}")
        refs.append(make_adapter(hf, directory, seed=20 + i, **spec).merge_and_unload().eval())
        loras.append(LoRARequest(f"e2e{i}", i + 1, str(directory)))
    return path, loras, [_reference(ref, p) for ref, p in zip(refs, PROMPTS)]


@torch.no_grad()
def _reference(hf, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """transformers' logits at every prompt position and its greedy tokens."""
    ids = list(prompt)
    logits = hf(torch.tensor([ids])).logits[0]
    for _ in range(NEW_TOKENS):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return logits, ids[len(prompt):]


def _lora_runner(path: Path, loras, mode: str, max_loras: int):
    """A float32 runner serving ``loras``: ``mode`` eager (the kernels' LoRA bank on the layer
    by layer path), fused (the bank inside the fused CPU step) or reference (PyTorch's)."""
    from tokenmill.model.loader import load_model
    from tokenmill.runner.lora import LoRAManager
    from tokenmill.runner.model_runner import ModelRunner

    loaded = load_model(str(path), "cpu", "float32")
    runner = ModelRunner(loaded, num_blocks=64, block_size=E2E_BLOCK)
    if mode == "fused":
        built = runner.fuse_cpu_step()
        assert built.startswith("fused"), built
    ops = None if mode == "reference" else \
        getattr(loaded.model.model.layers[0].self_attn.backend, "ops", None)
    runner.lora = LoRAManager(loaded.model, LoRAConfig(enable_lora=True, max_loras=max_loras),
                              loaded.config, torch.float32, ops)
    for lora in loras:
        if lora is not None:
            runner.lora.add(lora)
    return runner


def _generate(runner, prompts, loras) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Greedy decoding of ``prompts`` in one batch (each under its adapter): the prompt
    positions' logits and the new tokens of each."""
    tables = [list(range(1 + 2 * i, 3 + 2 * i)) for i in range(len(prompts))]
    chunks = [LoRAChunk(p, 0, t, len(p), SimpleNamespace(lora=lo))
              for p, t, lo in zip(prompts, tables, loras)]
    logits = runner.forward(chunks).split([len(p) for p in prompts])
    tokens = [[int(x[-1].argmax())] for x in logits]
    for step in range(NEW_TOKENS - 1):
        chunks = [LoRAChunk([out[-1]], len(p) + step, t, 1, SimpleNamespace(lora=lo))
                  for p, out, t, lo in zip(prompts, tokens, tables, loras)]
        for out, row in zip(tokens, runner.forward(chunks)):
            out.append(int(row.argmax()))
    return list(logits), tokens


@pytest.mark.parametrize("mode", ["eager", pytest.param("fused", marks=pytest.mark.skipif(
    not _f32_step_built(), reason="the CPU kernels' float32 GEMM is not built on this CPU")),
    "reference"])
def test_mixed_batch_matches_peft_merged_models(e2e, mode):
    path, loras, refs = e2e
    runner = _lora_runner(path, loras, mode, max_loras=4)
    logits, tokens = _generate(runner, PROMPTS, loras)
    for i, ((ref_logits, ref_tokens), got) in enumerate(zip(refs, logits)):
        torch.testing.assert_close(got, ref_logits, atol=E2E_TOL, rtol=0, msg=f"sequence {i}")
        assert tokens[i] == ref_tokens, f"sequence {i}"
    # each alone, its adapter swapped into the one slot: the mixed batch's rows, token for token
    alone = _lora_runner(path, loras, mode, max_loras=1)
    for i, lora in enumerate(loras):
        one_logits, one_tokens = _generate(alone, [PROMPTS[i]], [lora])
        assert one_tokens[0] == tokens[i]
        # float32 GEMMs here give a row the same bits in any batch
        assert torch.equal(one_logits[0], logits[i]), f"sequence {i}"
        if lora is not None:  # the adapter changes the model: the checks above have teeth
            base_logits, _ = _generate(alone, [PROMPTS[i]], [None])
            assert (base_logits[0] - logits[i]).abs().max() > 0.05
