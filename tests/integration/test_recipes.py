"""Every configuration the recipes hold, shrunk, trains for real: a recipe's own launch.sh, ds_config.json (offload
included) and train_args.yaml, 3 steps on 2 CPU ranks, a checkpoint that reloads. Recipes that differ only in size or
machine share one run (`TRAINED`). And `make plan-<size>` / `make train-<size>` from a laptop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from hf_zero3.config.presets import RECIPE_CONFIGS
from hf_zero3.plan.shapes import load_shape, with_changes
from tests.conftest import ROOT, explain, losses, make, plan_line, run

pytestmark = pytest.mark.integration

RECIPES = sorted(p.name for p in (ROOT / "recipes").iterdir() if p.is_dir()
                 and yaml.safe_load((p / "train_args.yaml").read_text()).get("stage", "sft") == "sft")
"""The recipes trained here on text; a preference recipe (pairs) runs in tests/integration/test_preference.py, in the
run that tests its stage, rather than in a 2-rank run of its own."""
SMALL = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "head_dim": 16, "vocab": 1024}
"""The shrunk size; kv heads keep the recipe's kind of attention (grouped-query or not)."""
SWAPPED = {**SMALL, "hidden": 512, "ffn": 1024, "head_dim": 128}
"""For NVMe recipes: DeepSpeed keeps a sub-group in memory below 1 MB (its aio block), so each rank's fp32 partition
must be larger (2.75M of the 5.5M parameters per rank here) for the swap, and its checkpoint copy, to happen."""


def shrunk_config(name: str, folder: Path) -> tuple[Path, str, int]:
    """A config.json of the recipe's full shape (written here: hub ids cannot be downloaded), the
    --config_overrides that shrink it, and the shrunk parameter count."""
    from transformers import LlamaConfig, Qwen3MoeConfig

    size = SWAPPED if RECIPE_CONFIGS[name].offloads_to_nvme else SMALL
    shape = load_shape(name)
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  head_dim=shape.head_dim, max_position_embeddings=shape.max_positions,
                  tie_word_embeddings=shape.tied_embeddings)
    if shape.experts:  # a mixture of experts keeps its expert count and top-k, each expert as narrow as the MLP
        Qwen3MoeConfig(**common, num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                       moe_intermediate_size=shape.expert_ffn).save_pretrained(folder)
    else:
        LlamaConfig(**common).save_pretrained(folder)
    kv = 1 if shape.kv_heads < shape.heads else size["heads"]
    experts = {"expert_ffn": size["ffn"] // 4} if shape.experts else {}
    small = with_changes(shape, **{k: v for k, v in size.items() if k != "head_dim"}, kv_heads=kv, **experts)
    overrides = (f"num_hidden_layers={size['layers']},hidden_size={size['hidden']},intermediate_size={size['ffn']},"
                 f"num_attention_heads={size['heads']},num_key_value_heads={kv},head_dim={size['head_dim']},"
                 f"vocab_size={size['vocab']}" + (f",moe_intermediate_size={size['ffn'] // 4}" if experts else ""))
    return folder, overrides, small.params


LORA = {name: yaml.safe_load((ROOT / "recipes" / name / "train_args.yaml").read_text()).get("peft") is not None
        for name in RECIPES}
"""The recipes that train a LoRA adapter (a `peft:` block) on a frozen base."""


def configuration(name: str) -> tuple:
    """What a recipe's real run exercises beyond its size: ZeRO stage, where optimizer and parameters live and what
    share of the optimizer steps on the CPU, precision, checkpointing, LoRA, experts, Liger's kernels, and whether a
    save gathers the 16-bit weights."""
    spec, args = RECIPE_CONFIGS[name], yaml.safe_load((ROOT / "recipes" / name / "train_args.yaml").read_text())
    return (spec.stage, spec.offload_optimizer.device, spec.offload_optimizer.ratio, spec.offload_param.device,
            spec.precision, spec.activation_checkpointing, LORA[name], bool(load_shape(name).experts),
            bool(args.get("use_liger_kernel")), spec.gather_16bit_weights_on_save)


TRAINED = sorted({configuration(n): n for n in reversed(RECIPES) if n != "tiny"}.values())
"""The first recipe of each configuration (tiny trains through its own launch.sh in test_tiny_recipe.py)."""


def pretrained(config: Path, overrides: str, folder: Path) -> Path:
    """The shrunk model with random weights, saved where a LoRA recipe's model_name_or_path points."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shrunk = AutoConfig.from_pretrained(config)
    shrunk.update_from_string(overrides)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(shrunk).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def recipe_runs(tmp_path_factory):
    """Each recipe's run, started on first use (so `-k 70b` runs one), shared by the tests below. A recipe that
    offloads to NVMe runs its own config with nvme_path pointed at a temporary folder; it needs DeepSpeed's async_io
    op (libaio), and is skipped where that cannot build (benchmarks/gpu_offload_70b_width.sh runs it on GPUs)."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            tmp = tmp_path_factory.mktemp(name)
            config, overrides, params = shrunk_config(name, tmp / "config")
            out = tmp / "run"
            nvme = []
            if RECIPE_CONFIGS[name].offloads_to_nvme:
                from deepspeed.ops.op_builder import AsyncIOBuilder

                if not AsyncIOBuilder().is_compatible():
                    pytest.skip("NVMe offload needs DeepSpeed's async_io op, which needs libaio (apt install "
                                "libaio-dev, or CFLAGS/LDFLAGS pointing at it)")
                ds_config = json.loads((ROOT / "recipes" / name / "ds_config.json").read_text())
                (tmp / "nvme").mkdir()
                ds_config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp / "nvme")
                (tmp / "ds_config.json").write_text(json.dumps(ds_config))
                nvme = ["--deepspeed", tmp / "ds_config.json"]
            model = ["--model_name_or_path", "null", "--config_name", config, "--config_overrides", overrides]
            if LORA[name]:  # LoRA trains on pretrained weights: the shrunk model's random weights, saved
                model = ["--model_name_or_path", pretrained(config, overrides, tmp / "base"), "--config_name", "null"]
            proc = run([ROOT / "recipes" / name / "launch.sh", *nvme, *model, "--tokenizer_name", "assets/tiny/model",
                        "--train_file", "assets/tiny/corpus/train.txt", "--validation_file", "null",
                        "--block_size", "64", "--max_steps", "3", "--logging_steps", "1", "--save_steps", "3",
                        "--learning_rate", "1.0e-3", "--warmup_steps", "0", "--output_dir", out],
                       NUM_NODES="1", NUM_GPUS="2", OMP_NUM_THREADS="1")
            done[name] = proc, out, params
        return done[name]

    return get


@pytest.mark.parametrize("name", TRAINED)
def test_recipe_trains_three_steps_on_two_ranks_with_its_own_config(recipe_runs, name):
    proc, out, _ = recipe_runs(name)
    assert proc.returncode == 0, explain(proc)
    spec = RECIPE_CONFIGS[name]
    assert ("hf_zero3.run.launch: deepspeed --num_nodes=1 --num_gpus=2 --master_port=" in proc.stdout
            and f"train.py recipes/{name}/train_args.yaml --deepspeed recipes/{name}/ds_config.json" in proc.stdout)
    assert f"hf_zero3: ZeRO stage {spec.stage} | world size 2 |" in proc.stdout
    resolved = json.loads((out / "run_config.json").read_text())
    recipe_config = json.loads((ROOT / "recipes" / name / "ds_config.json").read_text())
    ran = resolved["ds_config"]["zero_optimization"]
    for zero in (ran, recipe_config["zero_optimization"]):  # an NVMe recipe runs with its folder in tmp
        for block in ("offload_optimizer", "offload_param"):
            (zero.get(block) or {}).pop("nvme_path", None)
    assert {k: ran[k] for k in ("stage", "offload_optimizer", "offload_param") if k in ran} == {
        k: v for k, v in recipe_config["zero_optimization"].items() if k in ("stage", "offload_optimizer", "offload_param")}
    assert resolved["training"]["bf16"] == (spec.precision == "bf16")
    assert resolved["training"]["gradient_checkpointing"] == spec.activation_checkpointing
    recipe_args = yaml.safe_load((ROOT / "recipes" / name / "train_args.yaml").read_text())
    assert resolved["training"]["save_total_limit"] == recipe_args["save_total_limit"]  # as set, not as the Trainer saw it
    curve = losses(out)
    assert len(curve) == 3 and all(math.isfinite(x) for x in curve)
    assert curve[-1] < curve[0], curve


@pytest.mark.parametrize("name", TRAINED)
def test_recipe_checkpoint_is_complete_and_reloads(recipe_runs, name):
    from transformers import AutoModelForCausalLM

    proc, out, params = recipe_runs(name)
    assert proc.returncode == 0, explain(proc)
    checkpoint = out / "checkpoint-3"
    assert (checkpoint / "hf_zero3_complete.json").is_file()
    if LORA[name]:  # the adapter, verified at the save; merged into the base it is a plain HF folder
        assert not (checkpoint / "model.safetensors").exists() and (checkpoint / "adapter_model.safetensors").is_file()
        merged = run(["hf-zero3", "export", checkpoint, out.parent / f"{name}-merged", "--merge", "--dtype", "fp32"])
        assert merged.returncode == 0, explain(merged)
        checkpoint = out.parent / f"{name}-merged"
    elif not RECIPE_CONFIGS[name].gather_16bit_weights_on_save:  # ZeRO shards only: export makes the HF folder
        assert not (checkpoint / "model.safetensors").exists()
        exported = run(["hf-zero3", "export", checkpoint, out.parent / f"{name}-export", "--dtype", "fp32"])
        assert exported.returncode == 0, explain(exported)
        checkpoint = out.parent / f"{name}-export"
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == params
    batch = torch.arange(64).reshape(2, 32)
    with torch.no_grad():
        assert math.isfinite(model(input_ids=batch, labels=batch).loss.item())


@pytest.mark.parametrize("name", [n for n in TRAINED if RECIPE_CONFIGS[n].offloads_to_nvme])
def test_nvme_recipe_checkpoint_exports_the_weights_it_swapped(recipe_runs, name, tmp_path):
    """The fp32 weights of a swapped sub-group are a file in offloaded_tensors/, not in the optimizer shard (an empty
    tensor there); export reads them: its bf16 weights are the 16-bit model the run gathered, bit for bit."""
    from safetensors.torch import load_file

    proc, out, _ = recipe_runs(name)
    assert proc.returncode == 0, explain(proc)
    checkpoint = out / "checkpoint-3"
    shards = sorted((checkpoint / "global_step3").glob("*optim_states.pt"))
    groups = [torch.load(f, weights_only=False, map_location="cpu")["optimizer_state_dict"]["fp32_flat_groups"]
              for f in shards]
    assert len(groups) == 2 and all(g.numel() == 0 for rank in groups for g in rank)  # all swapped out to NVMe
    assert sorted(p.name for p in (checkpoint / "global_step3" / "offloaded_tensors").iterdir()) == ["rank00", "rank01"]
    exported = run(["hf-zero3", "export", checkpoint, tmp_path / "export"])
    assert exported.returncode == 0, explain(exported)
    gathered, weights = load_file(checkpoint / "model.safetensors"), load_file(tmp_path / "export/model.safetensors")
    assert weights.keys() == gathered.keys()
    assert all(torch.equal(weights[k], gathered[k]) for k in gathered), "export differs from the trained weights"
    resharded = run(["hf-zero3", "reshard", checkpoint])
    assert resharded.returncode != 0 and "keeps its optimizer states on NVMe" in resharded.stderr


@pytest.mark.parametrize("name", [n for n in TRAINED if RECIPE_CONFIGS[n].offload_optimizer.device == "cpu"])
def test_offloaded_recipes_step_with_deepspeeds_cpu_adam(recipe_runs, name):
    """The optimizer state in the checkpoint is DeepSpeed's own Adam over host-RAM partitions, not torch's AdamW."""
    proc, out, _ = recipe_runs(name)
    assert proc.returncode == 0, explain(proc)
    states = sorted((out / "checkpoint-3" / "global_step3").glob("*optim_states.pt"))
    assert len(states) == 2  # one partition per rank
    saved = torch.load(states[0], weights_only=False, map_location="cpu")
    assert saved["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    groups = saved["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"]
    assert "bias_correction" in groups[0] and "foreach" not in groups[0]  # DeepSpeedCPUAdam's keys, not torch's


def test_make_plan_70b_on_a_machine_without_gpus():
    proc = make("plan-70b")
    assert proc.returncode == 0, explain(proc)
    out = proc.stdout
    assert ("hf_zero3.run.launch: deepspeed --num_nodes=1 --num_gpus=8 --master_port=" in out
            and "train.py recipes/70b/train_args.yaml --deepspeed recipes/70b/ds_config.json" in out)
    assert plan_line(out, "batch").startswith("micro 1 x accumulation 8 x 8 ranks (1 node(s) x 8) = global batch 64 x "
                                              "4096 tokens = 262,144 tokens per optimizer step")
    assert "  gradient_checkpointing: True" in out  # the resolved TrainingArguments
    # the NVMe folder is the training nodes' business: named, not fatal, in a dry run on a laptop
    assert "/local_nvme does not exist on this machine" in out and "1 finding(s) for world size 8" in out
    assert plan_line(out, "hardware") == ("1 node(s) x 8 GPUs x 42.3 GB; host RAM 1,237.0 GB/node; NVMe 8,000.0 GB free "
                                          "at /local_nvme")
    assert plan_line(out, "recipe") == ("70b: ZeRO-3 + offload optimizer (nvme) + checkpointing, micro batch 1: 36.7 GB "
                                        "per GPU, 505.9 GB host RAM per node: fits (the planner's choice)")


def test_make_plan_70b_for_two_nodes_of_four(tmp_path):
    proc = make("plan-70b", NUM_NODES="2", NUM_GPUS="4", HOSTS="node1,node2", HOSTFILE=str(tmp_path / "hosts"))
    assert proc.returncode == 0, explain(proc)
    assert f"would write {tmp_path / 'hosts'}: node1 slots=4, node2 slots=4" in proc.stdout
    assert not (tmp_path / "hosts").exists()  # a dry run writes nothing
    assert (f"deepspeed --hostfile={tmp_path / 'hosts'} --num_nodes=2 --num_gpus=4 --master_port=29500 train.py "
            "recipes/70b/train_args.yaml --deepspeed recipes/70b/ds_config.json") in proc.stdout
    assert "36.7 GB per GPU, 325.4 GB host RAM per node: fits" in proc.stdout


def test_make_plan_fails_when_the_recipe_does_not_fit_the_gpus_asked_for():
    proc = make("plan-70b", NUM_GPUS="2")  # 2 x 40 GB for 70B
    assert proc.returncode != 0
    assert plan_line(proc.stdout, "recipe").startswith("70b: ZeRO-3 + offload optimizer (nvme) + checkpointing")
    assert "does NOT fit: GPU needs" in proc.stdout


@pytest.mark.parametrize("target", ["plan-70b", "train-70b"])
def test_wrong_nodes_and_hostfile_stop_before_anything_launches(tmp_path, target):
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=4\nnode2 slots=4\n")
    proc = make(target, NUM_NODES="3", NUM_GPUS="4", HOSTFILE=str(hosts))
    assert proc.returncode != 0
    assert f"error: NUM_NODES=3 but {hosts} lists 2 host(s): set NUM_NODES=2" in proc.stderr
    assert "hf_zero3.run.launch: deepspeed" not in proc.stdout  # nothing was started
    missing = make(target, NUM_NODES="2")
    assert missing.returncode != 0 and "error: NUM_NODES=2 needs the hosts: set HOSTFILE=path" in missing.stderr


def test_make_names_the_recipes_when_one_is_missing():
    proc = make("train-99b")
    assert proc.returncode != 0
    assert "error: no recipe recipes/99b/ (recipes: 10b-h200x1 13b 20b-h200x2 70b 70b-dpo-lora 70b-lora 7b 8b 8b-dpo qwen3-30b-a3b tiny)" in proc.stderr


def test_make_plan_of_a_from_scratch_recipe_plans_fp32_loading():
    proc = make("plan-tiny", GPU_MEM="8GB")  # the tiny recipe builds its model from a config
    assert proc.returncode == 0, explain(proc)
    assert "2 GPUs, seq 128, micro batch 8 x accumulation 1 x 2 ranks = global batch 16, fp32, sdpa, from scratch" \
        in proc.stdout and "1 node(s) x 2 GPUs x 8.0 GB" in proc.stdout, proc.stdout
    assert "(4 B x 1.0M (each rank loads the whole model))" in proc.stdout  # fp32 loading, planned
    assert plan_line(proc.stdout, "recipe").startswith("tiny: ZeRO-3, micro batch 8:")
