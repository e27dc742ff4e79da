"""Model shapes: exact parameter counts against real Llama modules, FLOPs per token, loading and its errors."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from hf_zero3 import recipes
from hf_zero3.plan.shapes import (
    PUBLISHED,
    ModelError,
    ModelShape,
    flops_per_token,
    load_shape,
    matmul_params,
    shape_from_config,
    with_changes,
)
from tests.conftest import error_naming

TINY_DIR = recipes.ROOT / "assets" / "tiny" / "model"


def _meta_llama(shape: ModelShape) -> LlamaForCausalLM:
    config = LlamaConfig(num_hidden_layers=shape.layers, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                         head_dim=shape.head_dim, tie_word_embeddings=shape.tied_embeddings,
                         attention_bias=shape.attention_bias, mlp_bias=shape.mlp_bias)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


@pytest.mark.parametrize("name", ["tiny", *sorted(PUBLISHED)])
def test_named_shape_counts_match_a_real_llama(name):
    shape = load_shape(name)
    model = _meta_llama(shape)
    assert shape.params == sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    assert shape.largest_module_params == largest  # DeepSpeed's "largest layer" (model_to_params)


@pytest.mark.parametrize("changes", [{"tied_embeddings": True}, {"attention_bias": True, "mlp_bias": True},
                                     {"head_dim": 48}])
def test_variants_match_a_real_llama(changes):
    shape = with_changes(load_shape("tiny"), **changes)
    model = _meta_llama(shape)
    assert shape.params == sum(p.numel() for p in model.parameters())  # tied weights are counted once


def test_published_sizes_and_a_hand_count():
    assert load_shape("7b").params == 6_738_415_616
    assert load_shape("13b").params == 13_015_864_320
    assert load_shape("70b").params == 68_976_648_192
    assert load_shape("8b").params == 8_030_261_248
    # tiny: embed 1024*128 + 4 x (attn 2*128*128 + 2*128*64 + mlp 3*128*352 + norms 2*128) + norm 128 + head
    assert load_shape("tiny").params == 131_072 + 4 * (49_152 + 135_168 + 256) + 128 + 131_072 == 1_000_576


def test_flops_per_token_is_palm_6n_plus_attention():
    shape = load_shape("7b")
    n = 6_738_415_616 - 32_000 * 4096  # every weight but the input embedding (lm_head kept: it is a matmul)
    assert matmul_params(shape) == n
    assert flops_per_token(shape, 4096) == 6 * n + 12 * 32 * 4096 * 4096 == 46_086_512_640
    tied = with_changes(shape, tied_embeddings=True)
    assert flops_per_token(tied, 4096) == flops_per_token(shape, 4096)  # tying saves memory, not FLOPs


def test_shape_from_config_folder_file_and_object():
    by_folder = load_shape(str(TINY_DIR))
    assert by_folder == with_changes(load_shape("tiny"), name=str(TINY_DIR))
    assert load_shape(str(TINY_DIR / "config.json")).params == 1_000_576
    config = AutoConfig.from_pretrained(TINY_DIR)
    shape = shape_from_config(config, "x")
    assert (shape.layers, shape.hidden, shape.ffn, shape.heads, shape.kv_heads, shape.vocab) == (4, 128, 352, 4, 2,
                                                                                                  1024)


def test_recipe_name_reads_its_model_and_overrides(tmp_path, monkeypatch):
    recipe = tmp_path / "recipes" / "small"
    recipe.mkdir(parents=True)
    (recipe / "train_args.yaml").write_text(f"config_name: {TINY_DIR}\nconfig_overrides: num_hidden_layers=2\n")
    monkeypatch.setattr(recipes, "RECIPES_DIR", tmp_path / "recipes")
    shape = load_shape("small")
    assert (shape.name, shape.layers, shape.hidden) == ("small", 2, 128)


def test_a_recipe_name_means_the_model_its_yaml_names(tmp_path, monkeypatch):
    """One registry: `--model 70b` is recipe 70b's model (its published shape offline), and a recipe of that name
    naming another model is planned for that model, not for a table of names."""
    assert load_shape("70b") == with_changes(PUBLISHED["meta-llama/Llama-2-70b-hf"], name="70b")
    assert load_shape("meta-llama/Llama-2-70b-hf").params == 68_976_648_192  # offline, gated or not
    recipe = tmp_path / "recipes" / "70b"
    recipe.mkdir(parents=True)
    (recipe / "train_args.yaml").write_text(f"config_name: {TINY_DIR}\n")
    monkeypatch.setattr(recipes, "RECIPES_DIR", tmp_path / "recipes")
    assert load_shape("70b").params == 1_000_576


def test_unknown_name_lists_what_is_accepted():
    with pytest.raises(ModelError) as err:
        load_shape("70B-chat")
    assert {"7b", "70b", "tiny"} <= set(recipes.names())
    error_naming(str(err.value), "unknown model '70B-chat'", *recipes.names(), "hub id")
    with pytest.raises(ModelError, match="unknown model"):
        load_shape("./missing/folder")


def test_unreachable_hub_id_says_how_to_work_offline(monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co'")

    monkeypatch.setattr(AutoConfig, "from_pretrained", offline)
    with pytest.raises(ModelError, match=r"org/private-model.*recipe.*HF_HUB_OFFLINE=1"):
        load_shape("org/private-model")


def test_bad_shapes_are_rejected():
    with pytest.raises(ModelError, match="multiple of kv_heads"):
        ModelShape("x", layers=2, hidden=64, ffn=128, heads=6, kv_heads=4, vocab=100)
    with pytest.raises(ModelError, match="layers must be >= 1"):
        ModelShape("x", layers=0, hidden=64, ffn=128, heads=4, kv_heads=4, vocab=100)
    with pytest.raises(ModelError, match="Llama-style"):
        shape_from_config({"hidden_size": 64}, "bert")
