"""Issue 15's levers: partial optimizer offload (`offload_optimizer.ratio`), headroom, and named machines, from the
spec through the ds_config and its check to the planner's arithmetic and choice."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from hf_zero3.cli import main
from hf_zero3.config.build import build_ds_config
from hf_zero3.config.check import check_ds_config
from hf_zero3.config.convert import spec_from_ds_config
from hf_zero3.config.spec import OptimizerOffload, ZeroSpec
from hf_zero3.plan.choose import choose
from hf_zero3.plan.memory import plan
from hf_zero3.plan.partitions import gpu_kept_optimizer_elements, rank_partitions, sub_groups
from hf_zero3.plan.profiles import PROFILES, get
from hf_zero3.plan.shapes import ModelShape
from hf_zero3.plan.types import Hardware, PlanError, Training
from hf_zero3.units import GB
from tests.conftest import error_naming, plan_line, plan_lines

GiB = 2**30
PARTIAL = ZeroSpec(offload_optimizer=OptimizerOffload(device="cpu", ratio=0.5), activation_checkpointing=True)
FULL = ZeroSpec(offload_optimizer=OptimizerOffload(device="cpu"), activation_checkpointing=True)
SHAPE = ModelShape("20b", layers=52, hidden=6144, ffn=16384, heads=48, kv_heads=8, vocab=32000)
H200X2 = Hardware(1, 2, 140 * GiB, 256 * GiB)


def test_ratio_is_written_only_when_partial_and_read_back():
    assert "ratio" not in build_ds_config(FULL)["zero_optimization"]["offload_optimizer"]
    config = build_ds_config(PARTIAL)
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.5}
    assert spec_from_ds_config(config)[0].offload_optimizer.ratio == 0.5
    assert check_ds_config(config) == []


@pytest.mark.parametrize("fields, message", [
    ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "needs ZeRO stage 3"),
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x", "ratio": 0.5}}, 'needs device "cpu"'),
    ({"offload_optimizer": {"device": "cpu", "ratio": 0.0}}, "greater than 0"),
])
def test_spec_refuses_what_deepspeed_refuses(fields, message):
    with pytest.raises(ValidationError, match=message):
        ZeroSpec(**fields)


def test_check_names_each_partial_offload_problem():
    config = build_ds_config(PARTIAL)
    config["zero_optimization"]["stage"] = 2
    config["optimizer"]["type"] = "SGD"
    config["zero_optimization"]["offload_optimizer"]["device"] = "nvme"
    texts = [f.message for f in check_ds_config(config) if f.key == "zero_optimization.offload_optimizer.ratio"]
    assert any("needs ZeRO stage 3" in t for t in texts) and any('needs offload_optimizer.device "cpu"' in t
                                                                 for t in texts)
    config = build_ds_config(PARTIAL)
    config["optimizer"]["type"] = "SGD"
    assert next(f.message for f in check_ds_config(config)).startswith("partial offload needs DeepSpeedCPUAdam")
    config["zero_optimization"]["offload_optimizer"]["ratio"] = 1.5
    first = check_ds_config(config)[0]  # DeepSpeed's own model says it first, under the same key
    assert (first.level, first.key) == ("error", "zero_optimization.offload_optimizer.ratio")
    assert "less than or equal to 1" in first.message


def test_kept_sub_groups_follow_deepspeeds_int_rule():
    # 10.34B elements per rank in sub-groups of 1e9: 11 sub-groups; int((1 - 0.5) x 11) = 5 stay on the GPU.
    assert gpu_kept_optimizer_elements(PARTIAL, 10_338_757_632) == (5_000_000_000, 11, 5)
    # One sub-group: int((1 - ratio) x 1) = 0 for any ratio > 0, so nothing stays (DeepSpeed behaves the same).
    assert gpu_kept_optimizer_elements(PARTIAL, 900_000_000)[0] == 0
    assert gpu_kept_optimizer_elements(FULL, 10_338_757_632)[0] == 0


def test_partial_offload_moves_16_bytes_per_kept_element_from_host_to_gpu():
    training = Training(4096, 2, 2)
    unpinned = lambda spec: ZeroSpec(**{**spec.model_dump(), "offload_optimizer": {
        **spec.offload_optimizer.model_dump(), "pin_memory": False}})
    partial, full = plan(SHAPE, H200X2, training, unpinned(PARTIAL)), plan(SHAPE, H200X2, training, unpinned(FULL))
    kept, groups, kept_groups = gpu_kept_optimizer_elements(PARTIAL, 0, rank_partitions(SHAPE, 2))
    assert (groups, kept_groups) == (11, 5) and 5_000_000_000 < kept < 5_400_000_000  # groups overshoot 1e9 a little
    assert full.host_bytes - partial.host_bytes == pytest.approx(2 * 16 * kept * 1.05, rel=1e-6)  # 2 GPUs, 5% margin
    always = lambda p: p.phase_total("always")
    assert always(partial) - always(full) == 16 * kept
    step_tmp = next(t for t in partial.terms if t.name.startswith("torch AdamW temporaries"))
    largest = max(sub_groups(PARTIAL, 0, rank_partitions(SHAPE, 2))[:kept_groups])
    assert step_tmp.bytes == 4 * largest and 1_000_000_000 <= largest < 1_100_000_000 and step_tmp.phase == "step"


@pytest.mark.parametrize("model_type, extra, world", [
    ("llama", {"vocab_size": 32000, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
               "num_attention_heads": 40, "num_key_value_heads": 40}, 2),
    ("qwen3_moe", {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 4,
                   "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                   "num_experts_per_tok": 8, "moe_intermediate_size": 768}, 1),
    ("mixtral", {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 8,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8}, 4),
])
def test_sub_groups_are_those_deepspeed_cuts_from_the_real_parameters(model_type, extra, world):
    """The planner's sub-groups equal DeepSpeed's own `_create_fp16_sub_groups` walked over the real model's
    parameters (meta device, each with ZeRO-3's padded partition size): fused experts make groups well over 1e9."""
    import math
    import types

    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_zero3.plan.shapes import shape_from_config

    config = AutoConfig.for_model(model_type, **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = list(model.parameters())
    for p in params:
        p.partition_numel = (lambda n: lambda: math.ceil(n / world))(p.numel())
    owner = types.SimpleNamespace(sub_group_size=PARTIAL.sub_group_size)
    theirs = [sum(p.partition_numel() for p in group)
              for group in DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(owner, params)]
    shape = shape_from_config(config.to_dict(), model_type)
    ours = sub_groups(PARTIAL, 0, rank_partitions(shape, world))
    assert len(ours) == len(theirs) and ours == pytest.approx(theirs, rel=1e-3)  # Qwen3-MoE's router comes after


def test_the_chooser_takes_the_least_offload_that_fits_and_headroom_makes_it_stricter():
    loose = choose(SHAPE, H200X2, 4096, global_batch=8)
    strict = choose(SHAPE, Hardware(1, 2, 140 * GiB, 256 * GiB, headroom=0.1), 4096, global_batch=8)
    assert loose.plan.spec.offload_optimizer.ratio < strict.plan.spec.offload_optimizer.ratio == 0.5
    assert strict.ds_config["zero_optimization"]["offload_optimizer"]["ratio"] == 0.5
    p = strict.plan
    assert p.gpu_bytes <= 0.9 * 140 * GiB and p.host_bytes <= 0.9 * 256 * GiB
    # every less offloaded option the chooser tried first fails the 10% headroom somewhere
    earlier = [q for q in strict.tried if q.fits is False and q.spec.offload_optimizer.ratio < 0.5
               and q.spec.offload_optimizer.device == "cpu"]
    assert earlier and all(q.problems() for q in earlier)
    with pytest.raises(PlanError, match="headroom must be in"):
        Hardware(1, 2, GB, GB, headroom=1.0)


def test_profiles_carry_their_figures_and_an_unknown_name_lists_the_known_ones():
    p4d = get("p4d.24xlarge")
    assert (p4d.gpus, p4d.host_ram, p4d.nvme) == (8, 1152 * GiB, 8 * 10**12)
    assert get("nd-a100-v4").host_ram == 900 * GiB and get("h200x2").host_ram == 256 * GiB
    hardware = p4d.hardware(nodes=1, headroom=0.1)
    assert hardware.nvme_path and hardware.nvme_free == p4d.nvme and hardware.headroom == 0.1
    assert all(p.source for p in PROFILES.values())
    with pytest.raises(PlanError, match="unknown hardware profile 'p5': use one of p4d.24xlarge"):
        get("p5")


def test_plan_cli_with_a_named_machine(capsys):
    assert main(["plan", "--model", "70b", "--hardware", "nd-a100-v4", "--headroom", "0.1", "--global-batch", "64",
                 "--json", "--trainer", "transformers"]) == 0  # a plain Trainer script's whole logits
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"]["profile"] == "nd-a100-v4" and out["hardware"]["host_ram"] == 900 * GiB
    assert out["choice"]["option"] == "ZeRO-3 + offload optimizer (nvme) + checkpointing"
    assert out["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    # without NVMe (a 2 x 4 node of 365 GB RAM) nothing fits, and the answer says what would
    assert main(["plan", "--model", "70b", "--hardware", "a2-highgpu-4g", "--nodes", "2", "--nvme-free", "1GB",
                 "--headroom", "0.1", "--global-batch", "64"]) == 1
    assert "nothing fits 70b on 2 node(s) x 4 GPUs" in capsys.readouterr().out
    assert main(["plan", "--model", "70b", "--hardware", "p5"]) == 2
    assert "unknown hardware profile" in capsys.readouterr().err


def test_pinned_blocks_are_rounded_up_to_powers_of_two_as_measured():
    """The 8b probe (benchmarks/results/2026-11-30_memory-probe-8b/zero3_offload_opt_rank0.json) measured
    24.000122 GiB pinned per rank: a 2^33 B block for the 8.03 GB bf16 gradient partition and four 2^32 B blocks for
    the 4 GB fp32 gradient sub-groups (plus a small remainder): what `pinned_blocks` + rounding predict."""
    from hf_zero3.plan.partitions import pinned_blocks, round_up_to_power_of_2

    part = -(-8_030_261_248 // 2)
    blocks = pinned_blocks(FULL, 2 * part, part, 0)
    assert [round_up_to_power_of_2(b) for b in blocks[:5]] == [2**33] + [2**32] * 4
    assert sum(round_up_to_power_of_2(b) for b in blocks) / GiB == pytest.approx(24.0, abs=0.01)
    assert plan(SHAPE, H200X2, Training(4096, 2, 2), FULL).host_bytes > plan(
        SHAPE, H200X2, Training(4096, 2, 2), ZeroSpec(**{**FULL.model_dump(), "offload_optimizer": {
            "device": "cpu", "pin_memory": False}})).host_bytes



def test_nvme_swap_buffers_are_not_rounded_only_the_gradient_partition_is():
    """The 70B-width NVMe run (benchmarks/results/2026-11-30_nvme-offload-70b-width/probe_rank0.json) measured 4.0 GiB
    pinned by torch per rank: its 2.24 GB bf16 gradient partition rounded to 2^32 B. The four 0.4 GB swap buffers
    are page-locked by DeepSpeed's aio handle, outside torch's allocator, and are not rounded."""
    from hf_zero3.plan.partitions import pinned_blocks, round_up_to_power_of_2

    nvme = ZeroSpec(stage=3, offload_optimizer={"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True},
                    sub_group_size=100_000_000)
    part = -(-2_235_604_992 // 2)
    blocks = pinned_blocks(nvme, 2 * part, part, 0)
    assert blocks == [2 * part] and round_up_to_power_of_2(blocks[0]) / GiB == 4.0

def test_config_new_writes_partial_unpinned_offload_and_the_oom_advice_names_it(capsys):
    assert main(["config", "new", "--stage", "3", "--offload-optimizer", "cpu", "--offload-ratio", "0.5",
                 "--no-pin-memory"]) == 0
    out = capsys.readouterr().out
    block = json.loads(out[:out.rindex("}") + 1])["zero_optimization"]["offload_optimizer"]
    assert block == {"device": "cpu", "pin_memory": False, "ratio": 0.5}
    assert main(["config", "new", "--stage", "2", "--offload-optimizer", "cpu", "--offload-ratio", "0.5"]) == 2
    assert "needs ZeRO stage 3 (stage is 2)" in capsys.readouterr().err
    from hf_zero3.plan.advice import _how

    now = plan(SHAPE, H200X2, Training(4096, 2, 2), ZeroSpec(activation_checkpointing=True))
    nxt = plan(SHAPE, H200X2, Training(4096, 2, 2), ZeroSpec(
        offload_optimizer=OptimizerOffload(device="cpu", ratio=0.5, pin_memory=False), activation_checkpointing=True))
    assert "--offload-optimizer cpu --offload-ratio 0.5 --no-pin-memory" in _how(now, nxt, None)


def test_the_70b_readme_quotes_the_predicted_nvme_time_per_step(capsys):
    from pathlib import Path

    from hf_zero3.plan.profiles import nvme_seconds_per_step

    readme = " ".join((Path(__file__).resolve().parents[2] / "recipes/70b/README.md").read_text().split())  # any wrap
    minutes = {name: nvme_seconds_per_step(1_103_630_000_000 // nodes, get(name)) / 60
               for name, nodes in (("p4d.24xlarge", 1), ("nd-a100-v4", 1), ("a2-highgpu-4g", 2))}
    assert f"about {minutes['p4d.24xlarge']:.1f} min per optimizer step on p4d" in readme
    assert f"{minutes['nd-a100-v4']:.1f} min on ND A100 v4" in readme
    assert f"about {minutes['a2-highgpu-4g']:.0f} min)" in readme
    assert main(["plan", "--model", "70b", "--hardware", "p4d.24xlarge", "--headroom", "0.1",
                 "--global-batch", "64"]) == 0
    out = capsys.readouterr().out
    error_naming("\n".join(plan_lines(out, "cost")), "NVMe swap", "207 s per optimizer step", "16 GB/s")


def test_host_oom_advice_offers_a_smaller_partial_offload_ratio():
    """After a host-RAM OOM, moving optimizer states back to the GPU (a lower ratio) is the way out when it fits."""
    import dataclasses

    from hf_zero3.config.presets import RECIPE_CONFIGS
    from hf_zero3.plan.advice import oom_advice
    from hf_zero3.plan.profiles import get
    from hf_zero3.plan.shapes import load_shape
    from hf_zero3.plan.types import Training

    hardware = dataclasses.replace(get("h200x2").hardware(1, 0.0), nvme_path=None, nvme_free=0)
    advice = oom_advice(load_shape("20b-h200x2"), hardware, Training(4096, 2, 2), RECIPE_CONFIGS["20b-h200x2"],
                        host=True)
    assert "Next step" in advice and "--offload-ratio 0." in advice, advice
    ratio = float(advice.split("--offload-ratio ")[1].split()[0])
    assert ratio < RECIPE_CONFIGS["20b-h200x2"].offload_optimizer.ratio


def test_an_unpinned_choice_says_what_it_costs(capsys):
    """Unpinned host buffers fit where pinned ones do not, at a measured price: the plan says so next to the choice."""
    assert main(["plan", "--model", "10b-h200x1", "--hardware", "h200x1", "--headroom", "0.1",
                 "--global-batch", "8", "--trainer", "transformers"]) == 0  # as measured: transformers' Trainer
    out = capsys.readouterr().out
    error_naming(plan_line(out, "choice"), "not pinned", "saves ZeRO shards", "micro batch 1")
    cost = next(c for c in plan_lines(out, "cost") if c.startswith("host buffers not pinned"))
    assert "--micro-batch" in cost and "pin_memory: true" in cost  # the two ways out, as the user types them
    assert main(["plan", "--model", "8b", "--hardware", "h200x2", "--global-batch", "96"]) == 0
    assert "host buffers not pinned" not in capsys.readouterr().out  # no offload chosen there
