"""`hf-zero3 plan`: sizes, tables, JSON, the written ds_config, exit codes and error messages."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from hf_zero3 import units
from hf_zero3.argtypes import parse_size
from hf_zero3.cli import main
from hf_zero3.config.check import check_ds_config, has_errors
from tests.conftest import error_naming, plan_line

SEED = ["plan", "--model", "70b", "--nodes", "1", "--gpus", "8", "--gpu-mem", "40GB"]


@pytest.mark.parametrize("text,expected", [("40GB", 40 * 10**9), ("80GiB", 80 * 2**30), ("512G", 512 * 2**30),
                                           ("1.5TB", 1_500_000_000_000), ("2 tib", 2 * 2**40), ("4096B", 4096)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["40", "forty GB", "40XB", "", "-1GB"])
def test_parse_size_rejects_with_examples(text):
    """The grammar (hf_zero3.units) raises a ValueError any layer can catch; the command lines' type turns it into
    argparse's error, with the same words."""
    with pytest.raises(ValueError, match=r"give a number with a unit, e.g. 40GB") as grammar:
        units.parse_size(text)
    assert not isinstance(grammar.value, argparse.ArgumentTypeError)
    with pytest.raises(argparse.ArgumentTypeError, match=r"give a number with a unit, e.g. 40GB"):
        parse_size(text)


def test_seed_command_table(capsys):
    assert main(SEED) == 0
    out = capsys.readouterr().out
    choice = plan_line(out, "choice")
    assert choice.startswith("ZeRO-3 + offload optimizer (cpu) + checkpointing:")
    error_naming(choice, "micro batch 1", "accumulation 1", "8 GPUs")
    error_naming(out, "1,668.2 GB host RAM per node", "--host-ram")  # pinned blocks rounded up, the save's gather
    assert "host RAM not given" in out
    for term in ("parameters, 16-bit", "gathered params (live)", "reduce bucket", "fused LM head + loss (TRL, in tiles)",
                 "CUDA context + NCCL buffers", "fp32 master weights + Adam m, v", "torch.cuda.max_memory_allocated"):
        assert term in out
    error_naming(out, "--gradient_checkpointing true", "--gradient_checkpointing_kwargs '{\"use_reentrant\": false}'")
    assert "activations: checkpointed layer inputs [backward]" in out and "[optimizer step]" not in out  # offloaded
    assert "pass --gpu-mem 40GiB to plan for all of it" in out  # an A100-40GB has 40 GiB


def test_two_nodes_json_and_written_config(capsys, tmp_path):
    path = tmp_path / "ds.json"
    argv = ["plan", "--model", "70b", "--nodes", "2", "--gpus", "4", "--gpu-mem", "40GB", "--host-ram", "1TB",
            "--global-batch", "64", "--json", "--write-config", str(path)]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    choice = result["choice"]
    assert (choice["stage"], choice["offload_optimizer"], choice["checkpointing"]) == (3, "cpu", True)
    assert choice["micro_batch"] * choice["grad_accum"] * 8 == 64
    assert round(choice["host_bytes"] / 1e9) == 907
    written = json.loads(path.read_text())
    assert written == result["ds_config"]
    assert written["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert not has_errors(check_ds_config(written, world_size=8, device="cuda"))
    assert result["training_args"]["per_device_train_batch_size"] == choice["micro_batch"]
    assert {t["name"] for t in result["breakdown"]["host"]} >= {"fp32 master weights + Adam m, v", "training processes"}


def test_nothing_fits_exits_1_and_writes_nothing(capsys, tmp_path):
    path = tmp_path / "ds.json"
    assert main([*SEED, "--host-ram", "1TB", "--write-config", str(path)]) == 1
    captured = capsys.readouterr()
    assert plan_line(captured.out, "result").startswith("nothing fits 70b")
    assert "It would fit on 2 nodes" in captured.out
    assert "no ds_config was written" in captured.err
    assert not path.exists()


def test_small_model_and_custom_shape(capsys):
    assert main(["plan", "--model", "tiny", "--gpus", "1", "--gpu-mem", "8GB", "--host-ram", "16GB"]) == 0
    # no global batch given: the largest micro batch that fits (the search stops at 64), not micro batch 1
    choice = plan_line(capsys.readouterr().out, "choice")
    assert choice.startswith("ZeRO-2:")
    error_naming(choice, "micro batch 64", "accumulation 1", "global batch 64")
    argv = ["plan", "--layers", "2", "--hidden", "64", "--ffn", "128", "--heads", "4", "--vocab", "100",
            "--gpus", "1", "--gpu-mem", "4GB", "--host-ram", "8GB", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["model"]["params"] == 100 * 64 * 2 + 2 * (4 * 64 * 64 + 3 * 64 * 128
                                                                                        + 2 * 64) + 64


@pytest.mark.parametrize("argv,message", [
    (["--model", "70B-chat", "--gpus", "8", "--gpu-mem", "40GB"], "unknown model '70B-chat'"),
    (["--hidden", "64", "--gpus", "8", "--gpu-mem", "40GB"], "pass --model NAME"),
    (["--model", "70b", "--gpus", "8", "--gpu-mem", "40GB", "--global-batch", "100"], "not a multiple of 8 GPUs"),
])
def test_bad_inputs_exit_2_naming_the_fix(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "8", "--gpu-mem", "40"], ["argument --gpu-mem", "'40'", "a number with a unit"]),
    (["--gpus", "0", "--gpu-mem", "40GB"], ["argument --gpus", "positive integer", "'0'"]),
    (["--gpus", "8", "--gpu-mem", "40GB", "--write-config", "."], ["argument --write-config", "is a folder"]),
])
def test_bad_arguments_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "70b", *argv])
    assert exit_info.value.code == 2
    error_naming(capsys.readouterr().err, *message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_no_gpu_here_asks_for_the_target_gpus(capsys):
    assert main(["plan", "--model", "7b"]) == 2
    error_naming(capsys.readouterr().err, "no GPU found", "--gpus N", "--gpu-mem SIZE")


def test_from_scratch_plans_fp32_loading_on_every_zero2_rank(capsys):
    """A model built from a config is initialized in fp32: below ZeRO-3 every rank holds 4 B/param at start."""
    argv = ["plan", "--model", "7b", "--gpus", "8", "--gpu-mem", "80GB", "--global-batch", "64", "--seq-len", "4096",
            "--json"]
    assert main(argv) == 0
    pretrained = json.loads(capsys.readouterr().out)["choice"]
    assert main([*argv, "--from-scratch"]) == 0
    scratch = json.loads(capsys.readouterr().out)["choice"]
    assert pretrained["option"] == scratch["option"] == "ZeRO-2"
    params = 6_738_415_616
    assert scratch["host_bytes"] - pretrained["host_bytes"] == pytest.approx(1.05 * 8 * 2 * params, rel=1e-6)


def test_liger_lets_micro_batch_3_fit_without_checkpointing(capsys):
    """Llama-3-8B on 2 x 140 GiB at micro batch 3 (recipe 8b v2): checkpointing is needed without Liger, not with it
    (no fp32 logits, smaller layers; measured 118.9 GiB allocated, benchmarks/results/2026-11-30_8b-tuned/llama3-8b_2xH200_2026-11-30_tuned.md)."""
    argv = ["plan", "--model", "8b", "--gpus", "2", "--gpu-mem", "140GiB", "--global-batch", "12", "--micro-batch", "3",
            "--seq-len", "4096", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["choice"]
    assert main([*argv, "--liger"]) == 0
    liger = json.loads(capsys.readouterr().out)["choice"]
    assert plain["option"].endswith("+ checkpointing") and liger["option"] == "ZeRO-3"


def test_the_plan_says_what_each_save_writes_and_when_the_disk_cannot_hold_it(capsys):
    """Recipe 10b-h200x1 saves ZeRO shards: 12 B x 10.73B = 128.8 GB, more than the single-H200 box's disk (its
    final save filled that disk, benchmarks/results/2026-12-01_pinned-offload-10b/report.md)."""
    assert main(["plan", "--model", "10b-h200x1", "--hardware", "h200x1", "--global-batch", "8", "--from-scratch",
                 "--headroom", "0.1"]) == 0
    saves = plan_line(capsys.readouterr().out, "saves")
    error_naming(saves, "a checkpoint 128.8 GB", "the final model 128.8 GB", "hf-zero3 export",
                 "68.7 GB left", "/local_nvme", "output_dir on a larger volume")
    assert main(["plan", "--model", "7b", "--hardware", "p4d.24xlarge"]) == 0  # ZeRO-2: rank 0 saves the module too
    saves = plan_line(capsys.readouterr().out, "saves")
    error_naming(saves, "a checkpoint 107.8 GB", "16-bit weights", "the final model 13.5 GB")
    assert "larger volume" not in saves


def test_plan_of_a_recipe_plans_its_block_size_unless_told_otherwise(capsys):
    """`plan --model <recipe>` plans the sequences the recipe trains: its block_size (8b-dpo: 2048, not 4096)."""
    base = ["plan", "--model", "8b-dpo", "--hardware", "h200x1", "--no-liger", "--json"]
    main(base)
    assert json.loads(capsys.readouterr().out)["seq_len"] == 2048
    main([*base, "--seq-len", "1024"])
    assert json.loads(capsys.readouterr().out)["seq_len"] == 1024
    main(["plan", "--model", "meta-llama/Meta-Llama-3-8B", "--hardware", "h200x1", "--json"])  # no recipe: 4096
    assert json.loads(capsys.readouterr().out)["seq_len"] == 4096


def test_plan_no_precompute_ref_plans_a_recipe_that_precomputes_with_its_reference(capsys, monkeypatch):
    """A full DPO recipe with stage_args.precompute_ref_log_probs: planned without the reference model, and with it
    under --no-precompute-ref."""
    from hf_zero3.cli import plan as plan_cli

    recipe = plan_cli._recipe_values
    monkeypatch.setattr(plan_cli, "_recipe_values", lambda args: {
        **recipe(args), "stage": "dpo", "stage_args": {"precompute_ref_log_probs": True}})
    base = ["plan", "--model", "8b", "--hardware", "h200x2", "--no-liger", "--json"]
    reference = lambda answer: any("reference model" in t["name"] for t in answer["breakdown"]["gpu"])
    main(base)
    assert not reference(json.loads(capsys.readouterr().out))
    main([*base, "--no-precompute-ref"])
    assert reference(json.loads(capsys.readouterr().out))
