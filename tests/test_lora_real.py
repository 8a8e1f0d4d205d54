"""LoRA adapters on the real default model (SmolLM2-135M-Instruct), made with PEFT on
transformers' float32 load of the same GGUF file: tokenmill's logits under each adapter equal
PEFT's ``merge_and_unload()`` model's, and greedy text is the same token for token, with base
and two adapters in one batch."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.test_lora_adapters import LoRAChunk

pytestmark = pytest.mark.slow  # the real model

PROMPTS = ["The capital of France is",
           "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
           "def fibonacci(n):\n    "]
ADAPTERS = {  # name -> PEFT LoraConfig arguments
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "all-r16": dict(r=16, lora_alpha=16, use_rslora=True,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj"]),
}
NEW_TOKENS = 16
# float32 against transformers' float32: the same sums in another order, 30 layers deep (the
# rank-16 adapter on every projection measured 1.07e-4 on one thread, 6.6e-5 for the base
# model); an adapter moves the logits by more than 0.5, so the bound keeps its teeth
LOGITS_TOL = 2e-4


@pytest.fixture(scope="module")
def references(hf_default_float32, tmp_path_factory):
    """transformers' base model and tokenizer, and per adapter its directory and PEFT's merged
    model (float32)."""
    from peft import LoraConfig, get_peft_model

    base, tok = hf_default_float32
    adapters = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(init_lora_weights=False,
                                                                    **spec))
        with torch.no_grad():  # random B, small enough that the text stays language
            for param_name, param in peft_model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.5)
        directory = tmp_path_factory.mktemp(name)
        peft_model.save_pretrained(directory)
        adapters[name] = (directory, peft_model.merge_and_unload().eval())
    return base, tok, adapters


@pytest.fixture(scope="module")
def served(references):
    """The default model in float32 on the planned path (the fused CPU step where it builds),
    serving the adapters, and their LoRARequests."""
    from tokenmill import LLM

    llm = LLM("smollm2-135m-instruct", dtype="float32", enable_lora=True, max_loras=2)
    loras = [llm.add_lora(name, str(d)) for name, (d, _) in references[2].items()]
    yield llm, loras
    llm.engine.shutdown()


def test_logits_under_each_adapter_match_peft_merge(references, served):
    """One batch: the prompt under the base model and under each adapter. Each adapter's logits
    are within 2e-4 of its merged model's -- or, on a CPU where tokenmill's float32 base model
    is already further than that from transformers', no further than the base is."""
    base, tok, adapters = references
    llm, loras = served
    runner = llm.engine.executor.worker  # its model runner, before any request used the cache
    ids = tok(PROMPTS[0])["input_ids"]
    sequences = [None, *loras]
    chunks = [LoRAChunk(ids, 0, [1 + 2 * i, 2 + 2 * i], len(ids), SimpleNamespace(lora=lo))
              for i, lo in enumerate(sequences)]
    ours = runner.forward(chunks).split([len(ids)] * len(sequences))
    with torch.no_grad():
        refs = [m(torch.tensor([ids])).logits[0]
                for m in (base, *(merged for _, merged in adapters.values()))]
    base_err = (ours[0] - refs[0]).abs().max().item()
    tol = max(LOGITS_TOL, 1.5 * base_err)
    for name, got, ref in zip(["base", *adapters], ours, refs):
        err = (got - ref).abs().max().item()
        assert err <= tol, f"{name}: logits {err:.2e} from the reference (base: {base_err:.2e})"
    for got, ref in zip(ours[1:], refs[1:]):  # each adapter moves the logits a lot
        assert (got - ours[0]).abs().max() > 0.5 and (ref - refs[0]).abs().max() > 0.5


def test_greedy_text_equals_peft_merge_in_one_mixed_batch(references, served):
    """Every prompt under base, adapter 1 and adapter 2, all in one ``LLM.generate``: each
    continuation equals transformers' greedy generation with PEFT's merged model."""
    from tokenmill import SamplingParams

    base, tok, adapters = references
    llm, loras = served
    models = [base, *(merged for _, merged in adapters.values())]
    jobs = [(p, lo, m) for p in PROMPTS for lo, m in zip([None, *loras], models)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([p for p, _, _ in jobs], params, lora_request=[lo for _, lo, _ in jobs])
    for (prompt, lora, model), out in zip(jobs, outs):
        ids = tok(prompt)["input_ids"]
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        ref_ids = ref[0, len(ids):].tolist()
        got = list(out.outputs[0].token_ids)
        name = lora.lora_name if lora else "base"
        assert got == ref_ids, f"{name}, {prompt!r}: {tok.decode(got)!r} != {tok.decode(ref_ids)!r}"
    texts = [tuple(o.outputs[0].token_ids) for o in outs]  # (prompt, model) in order
    for i, lora in enumerate(loras, 1):  # each adapter changes some continuation
        assert any(texts[j * 3 + i] != texts[j * 3] for j in range(len(PROMPTS))), lora
