"""The planner's preference stages (`plan.preference`): the reference model's partition, chosen and rejected in
one forward, against hand calculations; `hf-zero3 plan --stage dpo` prints them."""

from __future__ import annotations

import json
import math

from hf_zero3.cli import main
from hf_zero3.config.spec import ZeroSpec
from hf_zero3.plan.memory import plan
from hf_zero3.plan.preference import preference_of
from hf_zero3.plan.shapes import load_shape
from hf_zero3.plan.types import Hardware, Training
from tests.conftest import error_naming, plan_lines

SPEC = ZeroSpec(stage=3, precision="bf16", activation_checkpointing=True, micro_batch_size=2,
                gradient_accumulation_steps=1, global_batch_size=16)
A100X8 = Hardware(1, 8, 80 * 10**9, 1100 * 10**9)
SHAPE = load_shape("8b")


def terms(training: Training, spec=SPEC) -> dict[str, int]:
    return {t.name: t.bytes for t in plan(SHAPE, A100X8, training, spec).terms if t.where == "gpu"}


def test_dpo_adds_the_reference_partition_and_doubles_activations_and_logits():
    sft = terms(Training(2048, micro_batch=2))
    dpo = terms(Training(2048, micro_batch=2, preference=preference_of("dpo")))
    assert dpo["reference model, 16-bit (dpo)"] == 2 * math.ceil(SHAPE.params / 8)  # 2 B x P / 8 GPUs
    for name, value in sft.items():
        if name.startswith("checkpointed"):
            assert dpo[name] == 2 * value, name  # chosen and rejected: two sequences of 2048 per pair
    # the fused LM head has a fixed tile and lm_head gradient, so it and backward's working set are not twice SFT's:
    # the same as 4 sequences of SFT, plus the reference
    sequences = terms(Training(2048, micro_batch=4))
    assert {k: v for k, v in dpo.items() if "reference" not in k and "margin" not in k} == \
        {k: v for k, v in sequences.items() if "margin" not in k}


def test_no_second_model_with_lora_or_precomputed_log_probs_or_a_reference_free_loss():
    for pref in (preference_of("dpo", lora=True), preference_of("dpo", precompute=True), preference_of("orpo")):
        assert not any("reference" in name for name in terms(Training(2048, micro_batch=2, preference=pref)))
    assert preference_of("kto").sequences == 1 and preference_of("sft") is None
    whole = terms(Training(2048, micro_batch=2, preference=preference_of("kto")), SPEC.model_copy(update={"stage": 2}))
    assert whole["reference model, 16-bit (kto)"] == 2 * SHAPE.params  # ZeRO-1/2: TRL runs it at stage 0


def test_plan_stage_dpo_prints_the_reference_and_needs_more_memory(capsys):
    base = ["plan", "--model", "8b", "--hardware", "h200x1", "--seq-len", "2048", "--micro-batch", "2"]
    main([*base, "--json"])
    sft = json.loads(capsys.readouterr().out)
    main([*base, "--stage", "dpo", "--json"])
    dpo = json.loads(capsys.readouterr().out)
    names = [t["name"] for t in dpo["breakdown"]["gpu"]]
    assert "reference model, 16-bit (dpo)" in names, names
    assert dpo["breakdown_of"]["gpu_bytes"] > sft["breakdown_of"]["gpu_bytes"]
    assert any("chosen and rejected in one forward" in note for note in dpo["breakdown_of"]["notes"])


def test_the_oom_advice_of_a_dpo_run_plans_its_pairs_and_reference():
    import re
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from hf_zero3.config.build import build_ds_config
    from hf_zero3.run.oom import oom_advice_for_run

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    args = {"hf_deepspeed_config": SimpleNamespace(config=build_ds_config(ZeroSpec(stage=3))),
            "deepspeed": "ds.json", "bf16": True, "fp16": False, "gradient_checkpointing": True, "world_size": 8,
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    planned = {}
    for stage in ("sft", "dpo"):
        advice = oom_advice_for_run(config, SimpleNamespace(**args, stage=stage, stage_args={}), 2048,
                                    hardware=A100X8)
        planned[stage] = float(re.search(r"Planned for this run: ([\d.]+) GB", advice).group(1))
    reference = 2 * SHAPE.params / 8 / 1e9  # its 16-bit partition, GB
    assert planned["dpo"] - planned["sft"] > reference, planned


def test_the_runs_facts_carry_its_stage_and_precompute_to_the_planner():
    """The launcher's dry run (from the YAML's values) and the OOM advice (from TrainingArguments) ask the same fact."""
    from types import SimpleNamespace

    from hf_zero3.job.facts import RunFacts

    values = {"stage": "dpo", "stage_args": {"precompute_ref_log_probs": True}}
    assert RunFacts.from_values(values).preference(lora=False) == preference_of("dpo", precompute=True)
    assert RunFacts.from_values({"stage": "kto"}).preference(lora=False).reference == "engine"
    assert RunFacts.from_values({"stage": "dpo"}).preference(lora=True).reference == "none"
    assert RunFacts.from_values({}).preference(lora=False) is None
    args = SimpleNamespace(bf16=True, fp16=False, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                           gradient_checkpointing=False, stage="dpo", stage_args={"precompute_ref_log_probs": True})
    assert RunFacts.from_args(args, 2048).preference(lora=False) == preference_of("dpo", precompute=True)


def test_plan_stage_dpo_plans_length_for_pairs(capsys):
    """When nothing fits, the length planner plans the stage's pairs too, and offers a preference stage tiling only:
    sequence parallelism runs stage sft only."""
    base = ["plan", "--model", "8b", "--gpus", "2", "--gpu-mem", "90GB", "--host-ram", "1TB"]
    main([*base, "--seq-len", "98304"])
    assert "length " not in capsys.readouterr().out  # one sequence fits as it is
    main([*base, "--seq-len", "98304", "--stage", "dpo"])
    assert "length    chosen: sequence_parallel_size 1, tiled_compute true" in capsys.readouterr().out  # a pair: tiles
    main([*base, "--seq-len", "196608", "--stage", "dpo"])
    out = capsys.readouterr().out
    assert "sequence_parallel_size 2" not in out
    error_naming(plan_lines(out, "length")[-1], "nothing fits 196608 tokens", "a shorter sequence",
                 "sequence parallelism runs stage sft only")


def test_plan_of_a_preference_recipe_plans_its_stage_unless_told_otherwise(capsys):
    """`plan --model 70b-dpo-lora` plans the recipe's `stage: dpo` (pairs; LoRA: no second model), as its adapter."""
    base = ["plan", "--model", "70b-dpo-lora", "--hardware", "dgx-a100-80", "--headroom", "0.1", "--global-batch", "64",
            "--seq-len", "2048", "--no-liger", "--json"]
    main(base)
    recipe = json.loads(capsys.readouterr().out)
    main([*base, "--stage", "sft"])
    sft = json.loads(capsys.readouterr().out)
    pairs = lambda answer: any("chosen and rejected in one forward" in n for n in answer["breakdown_of"]["notes"])
    assert pairs(recipe) and not pairs(sft)
    assert not any("reference model" in t["name"] for t in recipe["breakdown"]["gpu"])
    assert (recipe["choice"]["micro_batch"], sft["choice"]["micro_batch"]) == (4, 8)  # a pair is two sequences
