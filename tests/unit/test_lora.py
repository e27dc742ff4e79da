"""LoRA's pieces on one process: the strict `peft:` block and its errors, the adapter checks a save must pass (real
shapes, the trained norms), the key rule against peft's own, the card, the disk estimate."""

from __future__ import annotations

import types

import pytest
import torch

from hf_zero3.checkpoint import contents
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.model import lora
from tests.conftest import ROOT, error_naming

TINY = str(ROOT / "assets/tiny/model")


def small_peft_model(targets="all-linear"):
    """A 1-layer Llama with a LoRA adapter (r 4) whose B is non-zero, as after some training."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return model


@pytest.fixture
def saved(tmp_path):
    model = small_peft_model()
    model.save_pretrained(tmp_path / "adapter")
    return model, tmp_path / "adapter"


@pytest.mark.parametrize("block, field, fix", [
    ({"r": 0}, "peft.r", "an integer >= 1"),
    ({"rank": 8}, "peft.rank", "write r: 8"),
    ({"alpha": 16}, "peft.alpha", "write lora_alpha: 16"),
    ({"dropout": 0.1}, "peft.dropout", "write lora_dropout: 0.1"),
    ({"lora_dropout": 1.0}, "peft.lora_dropout", "a fraction in [0, 1)"),
    ({"lora_alhpa": 16}, "peft.lora_alhpa", "did you mean lora_alpha?"),
    ({"target_modules": []}, "peft.target_modules", '"all-linear" or a list of module names'),
])
def test_a_bad_peft_block_names_the_field_and_the_fix(block, field, fix):
    with pytest.raises(ValueError) as e:
        lora.parse(block)
    assert str(e.value).startswith(f"{field}: ") and fix in str(e.value), e.value


def test_every_bad_field_is_named_at_once_and_a_good_block_is_peft_s_own_config():
    from peft import LoraConfig

    with pytest.raises(ValueError) as e:
        lora.parse({"r": -1, "alpha": 0, "colour": "red"})
    assert [line.split(":")[0] for line in str(e.value).splitlines()] == ["peft.r", "peft.alpha", "peft.colour"]
    config = lora.parse({"r": 8, "lora_alpha": 16, "lora_dropout": 0, "target_modules": ["q_proj", "v_proj"],
                         "use_rslora": True})  # any LoraConfig field
    assert isinstance(config, LoraConfig) and (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0)
    assert config.target_modules == {"q_proj", "v_proj"} and config.use_rslora and config.task_type == "CAUSAL_LM"
    assert lora.parse({}).target_modules == "all-linear" and lora.parse(None) is None


def test_peft_s_own_checks_are_named_too():
    """What only peft knows (here: layers_to_transform needs a list of target modules) fails before start too."""
    with pytest.raises(ValueError, match="^peft: .*layers_to_transform"):
        lora.parse({"target_modules": "all-linear", "layers_to_transform": [0]})


def test_targets_that_match_no_module_are_refused_before_start_with_the_modules_there():
    (problem,) = lora.problems({"peft": {"target_modules": ["q_proj", "qkv_proj"]}, "model_name_or_path": TINY})
    assert problem.startswith("peft.target_modules: qkv_proj match(es) no module of")
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in problem
    assert lora.problems({"peft": {"target_modules": ["q_proj", "v_proj"]}, "model_name_or_path": TINY}) == []
    (scratch,) = lora.problems({"peft": {}, "config_name": TINY})
    assert "set it to the base model" in scratch and "model_name_or_path" in scratch


def test_the_yaml_block_and_a_json_override_reach_the_model_arguments(tmp_path):
    from hf_zero3.job.arguments import load_arguments

    path = tmp_path / "run.yaml"
    path.write_text("model_name_or_path: base\npeft:\n  r: 8\n  target_modules: [q_proj, v_proj]\n")
    assert load_arguments([str(path)])["peft"] == {"r": 8, "target_modules": ["q_proj", "v_proj"]}
    assert load_arguments([str(path), "--peft", '{"r": 4, "lora_alpha": 8}'])["peft"] == {"r": 4, "lora_alpha": 8}


def test_the_saved_keys_are_the_parameter_names_by_peft_s_own_rule():
    from peft import get_peft_model_state_dict

    model = small_peft_model()
    trained = {contents.adapter_key(n) for n, p in model.named_parameters() if p.requires_grad}
    assert trained == set(get_peft_model_state_dict(model)) and len(trained) == 2 * 7


def test_a_saved_adapter_passes_against_the_trained_norms(saved):
    from hf_zero3.callbacks.adapter_check import trained_adapter, verify_on_all_ranks

    model, folder = saved
    expected = trained_adapter(model)
    assert len(expected) == 14 and all(norm > 0 for _, norm in expected.values())
    assert verify_on_all_ranks(model, folder) == [] and contents.verify_adapter(folder) == []
    assert contents.holds_adapter(folder) and contents.verify_weights(folder) == []


def test_placeholders_zeros_and_other_values_are_refused(saved):
    from safetensors.torch import save_file

    from hf_zero3.callbacks.adapter_check import trained_adapter

    model, folder = saved
    expected = trained_adapter(model)
    good = contents.adapter_tensors(folder)
    a, b = sorted(k for k in good if ".q_proj." in k)
    cases = {"placeholder": {**good, a: torch.empty(0)},  # what a ZeRO-3 module's own state dict holds
             "zeros": {**good, a: torch.zeros_like(good[a])},
             "other": {**good, b: 2 * good[b]},
             "missing": {k: v for k, v in good.items() if k != b}}
    found = {}
    for case, tensors in cases.items():
        save_file(tensors, str(folder / contents.ADAPTER_WEIGHTS))
        found[case] = contents.verify_adapter(folder, expected)
    assert found["placeholder"][0] == f"{a}: saved with shape (0,) (no values)"
    assert f"{a}: saved as zeros, but the trained tensor's norm is" in found["zeros"][0]
    assert found["other"] == [f"{b}: norm {2 * expected[b][1]:.6g} saved, {expected[b][1]:.6g} trained"]
    (missing,) = found["missing"]
    error_naming(missing, "1 trained adapter tensor(s) missing", "adapter_model.safetensors", b)
    save_file({**good, a: torch.zeros_like(good[a])}, str(folder / contents.ADAPTER_WEIGHTS))  # without the norms
    (zeroed,) = contents.verify_adapter(folder)
    error_naming(zeroed, f"{a}:", "all zeros", "lora_A at random")


def test_a_b_that_is_still_zero_passes_where_the_trained_one_is_zero_too(tmp_path):
    from hf_zero3.callbacks.adapter_check import trained_adapter

    model = small_peft_model()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()  # peft's start, kept by a first step at learning rate 0 (warm-up)
    model.save_pretrained(tmp_path)
    assert contents.verify_adapter(tmp_path, trained_adapter(model)) == []


def test_the_adapter_card_names_the_base_and_the_lora_settings(saved):
    from huggingface_hub import ModelCard

    from hf_zero3.checkpoint.card import model_card

    _, folder = saved
    card = ModelCard(str(model_card(folder, dtype="bf16", kind="adapter", base_model="meta-llama/Llama-3.1-8B")))
    assert card.data.base_model == "meta-llama/Llama-3.1-8B" and card.data.library_name == "peft"
    assert "lora" in card.data.tags
    assert "LoRA adapter (rank 4, alpha 8" in card.text and 'from_pretrained("meta-llama/Llama-3.1-8B")' in card.text
    local = str(model_card(folder, dtype="bf16", kind="merged", base_model=str(folder)))
    assert str(folder) not in local and "merged into the base weights" in local


def test_the_disk_estimate_of_a_peft_run_counts_only_the_adapter():
    from transformers import TrainingArguments

    from hf_zero3.callbacks.checkpoint_guard import _save_sizes

    model = small_peft_model()
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    checkpoint, final = _save_sizes(args, model)
    assert final.total == 4 * adapter and checkpoint.total == (4 + 8) * adapter  # weights + Adam moments



def test_merge_is_refused_for_a_full_model_checkpoint_before_anything_is_written(tmp_path):
    from hf_zero3.checkpoint.export import export_checkpoint
    from tests.conftest import make_checkpoint

    folder = make_checkpoint(tmp_path / "run", 2)
    with pytest.raises(ckpt.CheckpointError, match="holds a full model, not a LoRA adapter: --merge and --base"):
        export_checkpoint(folder, tmp_path / "merged", merge=True)
    assert not (tmp_path / "merged").exists()


def test_peft_before_0_19_beside_torchao_0_18_is_refused_before_start_naming_both_and_the_fix():
    """Seen on the GPU box (benchmarks/results/2026-12-03_lora-8b-h200/first-attempt_lora.log) and reproduced by hand
    with peft 0.18.1 + torchao 0.18.0 installed together: get_peft_model raises `cannot import name
    'LinearActivationQuantizedTensor' from 'torchao.quantization'` on any model. The rule, on version pairs."""
    problem = lora.torchao_problem({"peft": "0.18.1", "torchao": "0.18.0"})
    assert "peft 0.18.1" in problem and "torchao 0.18.0" in problem
    assert "`pip uninstall torchao`" in problem and "`pip install 'peft>=0.19'`" in problem
    assert lora.torchao_problem({"peft": "0.19.0", "torchao": "0.18.0"}) is None
    assert lora.torchao_problem({"peft": "0.18.1", "torchao": "0.17.0"}) is None
    assert lora.torchao_problem() is None  # this environment: peft without torchao, or a pair that works
    assert lora.problems({"peft": {"r": 8}, "model_name_or_path": TINY}) == []


def test_an_import_error_inside_get_peft_model_becomes_a_message_with_both_versions_and_the_fix(tmp_path,
                                                                                             monkeypatch):
    """A real reproduction needs peft < 0.19 beside torchao 0.18, which this environment does not install (its peft
    handles torchao 0.18): so a torchao package lacking the tensor class peft imports stands in for it, found by
    peft as an installed torchao 0.18.0. get_peft_model itself runs and raises the ImportError."""
    import sys

    from peft import import_utils

    package = tmp_path / "torchao"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text("")  # no TorchAOBaseTensor (peft >= 0.19 imports it as it adapts each layer)
    (tmp_path / "torchao-0.18.0.dist-info").mkdir()
    (tmp_path / "torchao-0.18.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torchao\n"
                                                                     "Version: 0.18.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    import_utils.is_torchao_available.cache_clear()  # peft caches whether torchao is there
    try:
        from transformers import LlamaConfig, LlamaForCausalLM

        base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1))
        with pytest.raises(ValueError) as raised:
            lora.apply(base, lora.parse({"r": 4}), types.SimpleNamespace(gradient_checkpointing=False, deepspeed=None))
    finally:
        import_utils.is_torchao_available.cache_clear()
        for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
            sys.modules.pop(name)
    message = str(raised.value)
    from importlib.metadata import version

    assert f"peft {version('peft')}" in message and "torchao: 0.18.0" in message
    assert "`pip uninstall torchao`" in message and "supports torchao 0.18.0" in message
    assert isinstance(raised.value.__cause__, ImportError)


@pytest.mark.parametrize("deepspeed, adapter_dtype", [({"bf16": {"enabled": True}}, torch.bfloat16),
                                                      (None, torch.float32)])
def test_under_deepspeed_the_adapter_computes_in_the_base_dtype(deepspeed, adapter_dtype):
    """DeepSpeed's optimizer keeps fp32 master weights, so the adapter stays bf16 like the base (at every ZeRO stage);
    without DeepSpeed peft's fp32 adapter is what the optimizer updates, and it stays."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1)).to(torch.bfloat16)
    model = lora.apply(base, lora.parse({"r": 4}), types.SimpleNamespace(gradient_checkpointing=False,
                                                                         deepspeed=deepspeed))
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {adapter_dtype} and all(p.dtype == torch.bfloat16 for n, p in model.named_parameters()
                                              if "lora_" not in n)
