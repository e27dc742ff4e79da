"""An export is generation-ready: the `use_cache: false` that training writes is not carried into it, so
`generate` reuses past_key_values (one new token per forward after the prompt) instead of recomputing them."""

from __future__ import annotations

import json

import torch

from hf_zero3.checkpoint.export import export_checkpoint
from tests.conftest import make_checkpoint


def _trained_checkpoint(tmp_path):
    """A checkpoint of a real (tiny) Llama, saved as training saves it: use_cache false in both configs."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=32, max_position_embeddings=64, bos_token_id=0,
                         eos_token_id=1, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    masters = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    folder = make_checkpoint(tmp_path, 4, masters=masters, weights=masters, marked=False)
    model.save_pretrained(tmp_path / "saved")  # config.json and generation_config.json as the Trainer writes them
    for name in ("config.json", "generation_config.json"):
        text = (tmp_path / "saved" / name).read_text()
        assert json.loads(text)["use_cache"] is False, name  # the precondition this test is about
        (folder / name).write_text(text)
    from hf_zero3.checkpoint import lifecycle as ckpt

    ckpt.write_marker(folder, {"world_size": 2})
    return folder


def test_export_turns_the_kv_cache_back_on_and_generate_uses_past_key_values(tmp_path):
    from transformers import AutoModelForCausalLM

    out = export_checkpoint(_trained_checkpoint(tmp_path), tmp_path / "export", dtype="fp32")
    for name in ("config.json", "generation_config.json"):
        assert json.loads((out / name).read_text())["use_cache"] is True, name
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.use_cache and model.generation_config.use_cache
    lengths = []
    model.model.register_forward_pre_hook(lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    prompt = torch.tensor([[0, 5, 6, 7, 8]])
    result = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                            return_dict_in_generate=True, pad_token_id=1)
    assert result.past_key_values is not None and result.past_key_values.get_seq_length() >= 8
    assert lengths == [5, 1, 1, 1], lengths  # the prompt once, then one token per step: the cache is used


def test_export_cli_takes_the_one_size_grammar(tmp_path, capsys):
    from safetensors.torch import load_file

    from hf_zero3.cli import main

    code = main(["export", str(_trained_checkpoint(tmp_path)), str(tmp_path / "out"), "--shard-size", "1KiB"])
    err = capsys.readouterr().err
    assert code == 0, err
    shards = sorted((tmp_path / "out").glob("model-*.safetensors"))
    assert len(shards) > 1  # 1 KiB (2^10 bytes) per shard: several shards for this ~4 KiB bf16 model
    assert all(sum(t.numel() * t.element_size() for t in load_file(s).values()) <= 1024 for s in shards)
    lines = [line for line in err.splitlines() if line.startswith("export: shard ")]  # progress, shard by shard
    assert len(lines) == len(shards) and lines[-1].startswith(f"export: shard {len(shards)}/{len(shards)} "), err
    assert " GB, " in lines[-1] and "ETA 0 s" in lines[-1], lines[-1]
