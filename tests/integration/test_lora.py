"""LoRA under ZeRO-3 on 2 CPU ranks with gradient checkpointing, on chat data (packed, the loss on the responses):
the base stays frozen and partitioned, DeepSpeed's optimizer holds only the adapter, the loss falls, each save's
adapter has its real shapes and reloads with `PeftModel.from_pretrained` to the logits the trained model gave; a
resumed run continues exactly; the merged export is base + (alpha / r) B A."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hf_zero3.checkpoint import contents
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, error_naming, explain, losses, run

pytestmark = pytest.mark.integration

R, ALPHA = 8, 16
LORA = ["--peft", json.dumps({"r": R, "lora_alpha": ALPHA, "lora_dropout": 0.0, "target_modules": "all-linear"}),
        "--gradient_checkpointing", "true", "--config_name", "null", "--validation_file", "null",
        "--train_file", "assets/tiny/chat/validation.jsonl", "--block_size", "256",  # chat, packed: 150 conversations
        "--logging_steps", "1", "--save_steps", "3", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
        "--warmup_steps", "0", "--max_steps", "6"]


def launch(probe, base, out, *extra):
    return run(["torchrun", "--nproc_per_node", "2", "--master_port", free_port(), "tests/integration/lora_probe.py",
                probe, TINY_YAML, "--model_name_or_path", base, "--output_dir", out, *LORA, *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A random-init tiny Llama saved as the base, then 6 LoRA steps on it (saves at 3 and 6)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model"))
    base.save_pretrained(root / "base")
    AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model").save_pretrained(root / "base")
    proc = launch(root / "probe", root / "base", root / "out")
    assert proc.returncode == 0, explain(proc)
    return root, proc


def probe(root, rank):
    return json.loads((root / "probe" / f"rank{rank}.json").read_text())


def test_the_base_is_frozen_and_partitioned_and_the_optimizer_holds_only_the_adapter(trained):
    root, proc = trained
    ranks = [probe(root, r) for r in (0, 1)]
    adapter = 4 * (R * 128 + 128 * R + R * 128 + 64 * R + R * 128 + 64 * R + R * 128 + 128 * R)  # q k v o
    adapter += 4 * (2 * (R * 128 + 352 * R) + R * 352 + 128 * R)  # gate, up, down
    assert ranks[0]["trainable"] == adapter == 74_752
    assert f"{adapter:,} trainable parameters of {adapter + 1_000_576:,}" in proc.stdout
    assert sum(r["optimizer_fp32"] for r in ranks) == adapter  # fp32 masters (and Adam states) of the adapter only
    assert all(r["frozen_whole"] == 1_000_576 and r["frozen_partition"] <= 1_000_576 // 2 + 64 for r in ranks)
    assert all(r["checkpointing"] for r in ranks)


def test_loss_falls_and_every_save_holds_the_adapter_with_its_real_shapes(trained):
    root, _ = trained
    curve = losses(root / "out")
    assert len(curve) == 6 and curve[-1] < curve[0] - 0.1, curve
    for folder in (root / "out/checkpoint-3", root / "out/checkpoint-6"):
        assert ckpt.is_complete(folder), folder
    for folder in (root / "out/checkpoint-3", root / "out/checkpoint-6", root / "out"):
        saved = contents.adapter_tensors(folder)
        assert len(saved) == 2 * 7 * 4 and all(t.numel() and t.norm() > 0 for t in saved.values()), folder
        assert not contents.verify_adapter(folder, shapes_from=root / "out/checkpoint-6")
        assert not (folder / "model.safetensors").exists()  # the frozen base is not saved again


def test_the_saved_adapter_reloads_to_the_trained_logits_and_merges_into_base_plus_adapter(trained, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_zero3.checkpoint.export import export_checkpoint
    from tests.integration.lora_probe import PROBE_INPUT

    root, _ = trained
    logits = torch.load(root / "probe" / "logits.pt")
    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    untrained = base(input_ids=PROBE_INPUT).logits
    reloaded = PeftModel.from_pretrained(base, root / "out").eval()
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=PROBE_INPUT).logits, logits, atol=1e-5)
    assert not torch.allclose(untrained, logits, atol=1e-3)  # the adapter changed what the model says

    adapter = export_checkpoint(root / "out/checkpoint-6", tmp_path / "adapter", dtype="fp32")
    merged = export_checkpoint(root / "out/checkpoint-6", tmp_path / "merged", dtype="fp32", merge=True)
    assert sorted(p.name for p in adapter.iterdir() if "token" not in p.name) == [
        "README.md", "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja"]
    assert "library_name: peft" in (adapter / "README.md").read_text()
    lora, weights, base_weights = (load_file(adapter / "adapter_model.safetensors"),
                                   load_file(merged / "model.safetensors"), load_file(root / "base/model.safetensors"))
    assert set(weights) == set(base_weights)
    merged_layers = 0
    for name, weight in base_weights.items():
        module = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{module}.lora_A.weight" in lora:
            weight = weight + ALPHA / R * lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"]
            merged_layers += 1
        assert torch.allclose(weights[name], weight, atol=1e-6), name
    assert merged_layers == 7 * 4
    with torch.no_grad():
        assert torch.allclose(AutoModelForCausalLM.from_pretrained(merged)(input_ids=PROBE_INPUT).logits, logits,
                              atol=1e-4)


def test_a_run_resumed_from_a_checkpoint_continues_exactly(trained, tmp_path):
    """checkpoint-3 copied to a new output_dir, resumed to step 6: the same losses and the same adapter."""
    root, _ = trained
    shutil.copytree(root / "out/checkpoint-3", tmp_path / "out/checkpoint-3")
    proc = launch(tmp_path / "probe", root / "base", tmp_path / "out", "--resume_from_checkpoint",
                  tmp_path / "out/checkpoint-3")
    assert proc.returncode == 0, explain(proc)
    assert losses(tmp_path / "out") == pytest.approx(losses(root / "out")[3:], abs=1e-5)
    resumed, straight = contents.adapter_tensors(tmp_path / "out"), contents.adapter_tensors(root / "out")
    assert all(torch.allclose(resumed[k], straight[k], atol=1e-6) for k in straight)


def test_a_lora_checkpoint_resumed_without_its_peft_block_is_one_line_before_start(trained, tmp_path, capsys):
    """The real checkpoint's own files say it holds an adapter: without the peft: block the run stops before
    anything starts (no DeepSpeed load of kilobytes of missing keys), naming the block to add; nothing written."""
    from hf_zero3.run.train import main

    root, _ = trained
    shutil.copytree(root / "out/checkpoint-3", tmp_path / "out/checkpoint-3")
    before = sorted(str(p) for p in (tmp_path / "out").rglob("*"))
    assert main([str(TINY_YAML), "--deepspeed", "null", "--model_name_or_path", str(root / "base"), "--output_dir",
                 str(tmp_path / "out"), *LORA[2:], "--resume_from_checkpoint", str(tmp_path / "out/checkpoint-3"),
                 "--peft", "null"]) == 2
    err = capsys.readouterr().err
    error_naming(err, "resume_from_checkpoint", "a LoRA adapter's checkpoint", f"'r': {R}", "peft: block")
    assert "Traceback" not in err and sorted(str(p) for p in (tmp_path / "out").rglob("*")) == before


def test_zero3_keeps_what_the_plan_counts_for_each_layer_of_a_bf16_lora_run(trained, tmp_path):
    """One rank, bf16, ZeRO-3 without checkpointing, dropout 0.05: ZeRO-3's linear (`model.zero3_linear`: a frozen
    layer's input is not kept) has replaced F.linear, the adapter is bf16 like the base (not peft's fp32: DeepSpeed
    keeps the fp32 master weights), and what decoder layer 1 saved in the first forward is the planner's term to the
    byte, plus the two small terms it leaves out (each norm's fp32 rsqrt, RoPE's bf16 cos and sin per position) and
    with a CPU's dropout mask in its input's dtype (bf16 here; CUDA keeps a bool)."""
    from hf_zero3.config.build import build_ds_config
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.lora import adapter
    from hf_zero3.plan.memory import lora_layer_activation_bytes
    from hf_zero3.plan.shapes import load_shape
    from hf_zero3.plan.types import Training

    root, _ = trained
    spec = ZeroSpec(stage=3, precision="bf16")
    (tmp_path / "ds.json").write_text(json.dumps(build_ds_config(spec)))
    peft = {"r": R, "lora_alpha": ALPHA, "lora_dropout": 0.05, "target_modules": "all-linear"}
    proc = run(["torchrun", "--nproc_per_node", "1", "--master_port", free_port(), "tests/integration/lora_probe.py",
                tmp_path / "probe", TINY_YAML, "--model_name_or_path", root / "base", "--config_name", "null",
                "--output_dir", tmp_path / "out", "--peft", json.dumps(peft), "--deepspeed", tmp_path / "ds.json",
                "--bf16", "true", "--validation_file", "null", "--train_file", "assets/tiny/corpus/validation.txt",
                "--max_steps", "1", "--save_strategy", "no", "--save_final_model", "false"])
    assert proc.returncode == 0, explain(proc)
    seen = json.loads((tmp_path / "probe" / "saved0.json").read_text())
    assert seen["zero3_linear"] is True
    assert seen["dtypes"] == {"adapter": ["torch.bfloat16"], "base": ["torch.bfloat16"]}
    began = json.loads((tmp_path / "probe" / "rank0.json").read_text())
    assert began["optimizer_fp32"] == began["trainable"]  # the bf16 adapter's fp32 master weights
    shape, micro, seq = load_shape(str(root / "base")), 8, 128  # the tiny recipe's micro batch and block size
    assert seen["tokens"] == micro * seq
    planned = lora_layer_activation_bytes(shape, spec, Training(seq, micro, adapter=adapter(shape, R, "all-linear",
                                                                                              0.05)), mask_bytes=2)
    assert seen["saved_bytes"] / seen["tokens"] == planned + 2 * 4 + 2 * 2 * shape.head_dim / micro
