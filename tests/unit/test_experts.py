"""Expert blocks found from a model's structure, the leaf modules put into a run's ds_config, the planner's MoE
shapes against real models on the meta device, and the saved layout of fused experts."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from hf_zero3.checkpoint.names import saved_shapes
from hf_zero3.plan.experts import expert_count, leaf_classes, leaf_modules
from hf_zero3.plan.shapes import flops_per_token, matmul_params, shape_from_config
from hf_zero3.model.experts import set_leaf_modules
from tests.conftest import ROOT, error_naming

TINY = ROOT / "assets/tiny"


def meta(config):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tiny(name):
    return meta(AutoConfig.from_pretrained(TINY / name))


def test_the_moe_block_of_each_family_is_the_leaf_and_a_dense_model_has_none():
    assert leaf_modules(tiny("mixtral")) == {"model.layers.0.mlp": "MixtralSparseMoeBlock",
                                             "model.layers.1.mlp": "MixtralSparseMoeBlock"}
    assert leaf_classes(tiny("qwen3-moe")) == ["Qwen3MoeSparseMoeBlock"]
    assert leaf_modules(tiny("model")) == {} and expert_count(AutoConfig.from_pretrained(TINY / "model")) == 0


def test_per_expert_module_lists_are_found_too_and_partitioned_shapes_are_read():
    """A remote-code style block: experts as a ModuleList, the router a Linear beside it; ZeRO-3 has emptied every
    parameter (its full shape kept in ds_shape), as when the model was built under zero.Init."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(8, 3, bias=False)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn, self.mlp = torch.nn.Linear(8, 8), Block()

    model = torch.nn.Sequential(Layer(), Layer())
    model.config = types.SimpleNamespace(num_local_experts=3)
    for p in model.parameters():
        p.ds_shape, p.data = p.shape, torch.empty(0)
    assert leaf_modules(model) == {"0.mlp": "Block", "1.mlp": "Block"}


def ds_args(zero: dict):
    return types.SimpleNamespace(deepspeed="x.json", hf_deepspeed_config=types.SimpleNamespace(
        config={"zero_optimization": zero}))


def test_the_leaf_classes_go_into_a_zero3_ds_config_and_nowhere_else():
    model = tiny("mixtral")
    args = ds_args({"stage": 3})
    assert "MixtralSparseMoeBlock x2" in set_leaf_modules(model, None, args)
    assert args.hf_deepspeed_config.config["zero_optimization"]["leaf_module"] == {"classes": ["MixtralSparseMoeBlock"]}
    stage2 = ds_args({"stage": 2})
    assert set_leaf_modules(model, None, stage2) is None and "leaf_module" not in stage2.hf_deepspeed_config.config[
        "zero_optimization"]
    dense = ds_args({"stage": 3})
    assert set_leaf_modules(tiny("model"), None, dense) is None
    assert dense.hf_deepspeed_config.config == {"zero_optimization": {"stage": 3}}  # a dense model: unchanged


def test_the_users_own_leaf_modules_win_and_a_wrong_class_names_the_right_ones():
    model = tiny("mixtral")
    own = ds_args({"stage": 3, "leaf_module": {"names": ["model.layers.0.mlp"]}})
    assert "from the ds_config" in set_leaf_modules(model, ["MixtralExperts"], own)
    assert own.hf_deepspeed_config.config["zero_optimization"]["leaf_module"] == {"names": ["model.layers.0.mlp"]}
    chosen = ds_args({"stage": 3})
    set_leaf_modules(model, ["MixtralExperts"], chosen)
    assert chosen.hf_deepspeed_config.config["zero_optimization"]["leaf_module"] == {"classes": ["MixtralExperts"]}
    off = ds_args({"stage": 3})
    assert "none" in set_leaf_modules(model, [], off) and "leaf_module" not in off.hf_deepspeed_config.config[
        "zero_optimization"]
    with pytest.raises(ValueError) as err:
        set_leaf_modules(model, ["MixtralBlock"], ds_args({"stage": 3}))
    error_naming(str(err.value), "MixtralBlock", "not a module class", "MixtralSparseMoeBlock")


QWEN3_30B_A3B = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                               num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                               num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)
"""Qwen/Qwen3-30B-A3B's published config.json, the keys that fix its shape."""


@pytest.mark.parametrize("config", [
    QWEN3_30B_A3B,
    MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2),
    Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
                   mlp_only_layers=[0], decoder_sparse_step=1, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=100, num_experts=8, num_experts_per_tok=2),
], ids=["qwen3-30b-a3b", "mixtral-8x7b", "qwen3-moe-dense-first-layer"])
def test_moe_parameter_counts_and_tensor_sizes_match_the_real_model(config):
    shape, model = shape_from_config(config), meta(config)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert sorted(n for n, k in shape.tensor_sizes() for _ in range(k)) == sorted(p.numel() for p in model.parameters())
    blocks = [m for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")]
    assert shape.largest_module_params == sum(p.numel() for p in blocks[0].parameters())


def test_flops_count_the_active_experts_only():
    shape = shape_from_config(QWEN3_30B_A3B)
    assert round(shape.params / 1e9, 2) == 30.53 and round(shape.active_params / 1e9, 2) == 3.35  # "A3B"
    assert matmul_params(shape) == shape.active_params - shape.embedding_params
    assert flops_per_token(shape, 4096) == 6 * matmul_params(shape) + 12 * 48 * 4096 * 4096


def test_fused_experts_map_to_the_per_expert_names_save_pretrained_writes(tmp_path):
    config = AutoConfig.from_pretrained(TINY / "mixtral")
    config.save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(tmp_path / "saved/model.safetensors", "pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert saved_shapes(tmp_path, {n: tuple(p.shape) for n, p in model.named_parameters()}) == written
    dense = {"model.norm.weight": (128,)}
    assert saved_shapes(TINY / "model", dense) == dense


def test_loading_a_moe_under_zero3_plans_two_copies_of_one_block():
    """Measured: the per-expert tensors as read and their fused copy (benchmarks study moe-load-rss)."""
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.memory import plan
    from hf_zero3.plan.types import Hardware, Training

    shape = shape_from_config(QWEN3_30B_A3B)
    hardware = Hardware(nodes=1, gpus_per_node=8, gpu_mem=10**12, host_ram=None)
    loading = {s: next(t.bytes for t in plan(shape, hardware, Training(4096, load_bytes=2), ZeroSpec(
        precision="bf16", stage=s)).terms if t.name == "loading weights") for s in (2, 3)}
    assert loading[3] == 8 * 2 * 2 * shape.expert_block_params()
    assert loading[2] == 8 * 2 * shape.params  # below ZeRO-3 each rank loads the whole model, fused once
