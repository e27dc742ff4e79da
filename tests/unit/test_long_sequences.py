"""Long sequences, one process: tiled compute trains the same loss and gradients as the untiled model (full and
LoRA, and through TRL's fused LM head); the sequence-parallel checks name the field and the fix; the collator hands the sequence-sharding loader
what it needs; the packed mask keeps examples apart."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from hf_zero3.model import tiled_compute
from hf_zero3.run import sequence_parallel
from tests.conftest import ROOT, error_naming
from tests.unit.test_lora import small_peft_model


def _tiny():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(ROOT / "assets/tiny/model")
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).train()


def _loss_and_grads(model, ids, labels, **extra):
    loss = model(input_ids=ids, labels=labels, **extra).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
def test_tiled_compute_gives_the_untiled_loss_and_gradients(lora):
    plain = small_peft_model() if lora else _tiny()
    tiled = copy.deepcopy(plain)
    assert tiled_compute.enable(tiled, tile_tokens=24) > 0  # 100 tokens: 5 tiles, the last one short
    torch.manual_seed(1)
    vocab = plain.config.vocab_size
    ids = torch.randint(0, vocab, (2, 100))
    labels = ids.clone()
    labels[0, :10] = -100
    loss, grads = _loss_and_grads(plain, ids, labels)
    tiled_loss, tiled_grads = _loss_and_grads(tiled, ids, labels)
    assert abs(loss - tiled_loss) < 1e-5
    assert grads.keys() == tiled_grads.keys() and grads
    assert max((grads[k] - tiled_grads[k]).abs().max().item() for k in grads) < 1e-6


def test_tiling_keeps_trls_fused_lm_head_its_token_count_and_evaluation():
    """The trainers compute the loss through TRL's fused LM head (already tiled): tiling the MLPs leaves it in
    place, with the trainer's token count, and leaves evaluation alone."""
    from trl.trainer.utils import add_fused_lm_head

    plain, tiled = _tiny(), _tiny()
    for model in (plain, tiled):
        add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))
    tiled_compute.enable(tiled, tile_tokens=16)
    ids = torch.randint(0, 1000, (1, 64))
    for count in (None, torch.tensor(200)):  # num_items_in_batch: the tokens of the whole accumulated batch
        extra = {"fused_lm_head": True, **({} if count is None else {"num_items_in_batch": count})}
        loss, grads = _loss_and_grads(plain, ids, ids, **extra)
        tiled_loss, tiled_grads = _loss_and_grads(tiled, ids, ids, **extra)
        assert abs(loss - tiled_loss) < 1e-5
        assert max((grads[k] - tiled_grads[k]).abs().max().item() for k in grads) < 1e-6
        plain.zero_grad(), tiled.zero_grad()
    assert tiled(input_ids=ids, labels=ids, fused_lm_head=True).label_mask.sum() == 63  # what the trainer logs by
    assert "position_ids" in inspect.signature(tiled.forward).parameters  # the Trainer keeps the columns it names
    tiled.eval()
    with torch.no_grad():
        assert tiled(input_ids=ids, labels=ids).logits.shape == (1, 64, 1024)


@pytest.mark.parametrize("values, field, fix", [
    ({"sequence_parallel_size": 3, "deepspeed": {}}, "world size 4", "multiple of 3"),
    ({"sequence_parallel_size": 2, "block_size": 129, "deepspeed": {}}, "block_size 129", "multiple of 2"),
    ({"sequence_parallel_size": 2, "attn_implementation": "eager", "deepspeed": {}}, "attn_implementation eager",
     "sdpa"),
    ({"sequence_parallel_size": 2}, "needs DeepSpeed", "set deepspeed"),
    ({"sequence_parallel_size": 2, "deepspeed": {"zero_optimization": {"stage": 3, "reduce_scatter": False}}},
     "reduce_scatter", "set reduce_scatter true"),
    ({"sequence_parallel_size": 0}, "sequence_parallel_size", ">= 1"),
    ({"sequence_parallel_size": 2, "stage": "dpo", "deepspeed": {}}, "stage sft only", "sequence_parallel_size 1"),
])
def test_sequence_parallel_problems_name_the_field_and_the_fix(values, field, fix):
    error_naming("\n".join(sequence_parallel.problems_of(values, world_size=4)), field, fix)


def test_a_good_sequence_parallel_run_and_a_fixed_deepspeed_pass():
    good = {"sequence_parallel_size": 2, "block_size": 128, "attn_implementation": "sdpa",
            "deepspeed": {"zero_optimization": {"stage": 3}}}
    assert sequence_parallel.problems_of(good, world_size=4) == []
    assert sequence_parallel.problems_of({"block_size": 127}, world_size=3) == []  # off: nothing to check
    off = {"zero_optimization": {"stage": 3, "reduce_scatter": False}}
    assert sequence_parallel.reduce_scatter_problem(off, 2, deepspeed_version="0.20.2") is None
    assert sequence_parallel.reduce_scatter_problem(off, 2, deepspeed_version="0.19.8") is not None


def test_trls_collator_pads_to_the_group_and_ours_drops_whole_sequence_boundaries(tmp_path):
    """Under sequence parallelism the run asks TRL's collator for lengths that divide by the group
    (`pad_to_multiple_of`, with position_ids as SFTTrainer asks for them); ours drops flash attention's boundaries."""
    import types

    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from hf_zero3.job.arguments import TrainingArguments
    from hf_zero3.run.sft import PackedRows, as_sft_config

    data = types.SimpleNamespace(block_size=128, preprocessing_num_workers=None)
    for sp, multiple in ((4, 4), (1, None)):
        args = TrainingArguments(output_dir=str(tmp_path), sequence_parallel_size=sp, report_to=[], use_cpu=True)
        assert as_sft_config(args, data, "padded").pad_to_multiple_of == multiple
    trl = DataCollatorForLanguageModeling(pad_token_id=3, pad_to_multiple_of=4, return_position_ids=True)
    batch = sequence_parallel.ShardableCollator(trl)([{"input_ids": [5, 6, 7, 8, 9]}, {"input_ids": [5, 6]}])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (2, 8)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]  # padding: examples of their own
    assert batch["labels"][0, 5:].tolist() == [-100] * 3 and batch["input_ids"][0, 5:].tolist() == [3] * 3
    flat = DataCollatorForLanguageModeling(pad_token_id=3, pad_to_multiple_of=4, padding_free=True)
    batch = sequence_parallel.ShardableCollator(flat)([{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6]}])
    assert batch["input_ids"].shape == (1, 8) and not set(sequence_parallel.VARLEN_KEYS) & set(batch)
    assert PackedRows(3, 4)([{"input_ids": [5, 6, 7], "seq_lengths": [2, 1]}])["input_ids"].shape == (1, 4)


def test_the_packed_mask_is_causal_within_each_example_only():
    mask = sequence_parallel.document_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]
    assert mask.tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]


def _llama8b():
    from hf_zero3.plan.shapes import load_shape

    return load_shape("meta-llama/Meta-Llama-3-8B")


def test_the_planner_reaches_a_length_with_tiling_on_one_gpu():
    from hf_zero3.plan.length import plan_length
    from hf_zero3.plan.types import Hardware
    from hf_zero3.units import GB

    shape, h200 = _llama8b(), Hardware(1, 1, 141 * GB, 2000 * GB)
    # TRL's fused LM head never holds the logits (1.5 MB a token whole): 128K tokens fit untiled
    assert (plan_length(shape, h200, 131072).best.sp, plan_length(shape, h200, 131072).best.tiled) == (1, False)
    one = plan_length(shape, h200, 327680)
    assert one.best is not None and (one.best.sp, one.best.tiled) == (1, True)
    assert not one.tried[0].choice.fits  # untiled, the MLPs' intermediates do not fit
    assert one.best.choice.training_args["tiled_compute"] is True
    assert "use_liger_kernel" not in one.best.choice.training_args
    # on a node: test_plan_seq_len_names_the_sequence_parallel_size_and_tiling_that_fit


def test_the_planner_says_why_nothing_fits_a_length():
    from hf_zero3.plan.length import plan_length
    from hf_zero3.plan.types import Hardware
    from hf_zero3.units import GB

    none = plan_length(_llama8b(), Hardware(1, 1, 80 * GB, 2000 * GB), 1 << 22)
    assert none.best is None
    assert "nothing fits 4194304 tokens" in none.why_not and "larger sequence_parallel_size" in none.why_not
    assert "GPU needs" in none.why_not and "host RAM" not in none.why_not
    # Where the GPU would hold it but the host cannot (offloaded states and activations), the answer says host RAM.
    host = plan_length(_llama8b(), Hardware(1, 1, 80 * GB, 128 * GB), 65536)
    assert host.best is None and "still lacks: host RAM needs" in host.why_not and "GPU needs" not in host.why_not
    assert host.why_not.endswith("or more host RAM")


def test_tiling_takes_the_mlp_and_the_logits_out_of_the_per_token_activations():
    from hf_zero3.plan.length import all_to_all_bytes, per_token

    shape = _llama8b()
    plain, tiled = per_token(shape, "bf16", "sdpa", False), per_token(shape, "bf16", "sdpa", True)
    # TRL's fused LM head, tiled or not: the fp32 input gradient, its cast, the kept input, a few vectors
    assert plain["layer"] - tiled["layer"] == 4 * 2 * shape.ffn and plain["logits"] == tiled["logits"] == 8 * 4096 + 32
    stock = per_token(shape, "bf16", "sdpa", False, trainer="transformers")  # a plain Trainer's whole logits
    assert stock["logits"] == 12 * shape.vocab and per_token(shape, "bf16", "sdpa", True, "transformers")["logits"] == 0
    # q, k, v and the output: (2 x 4096 + 2 x 1024) x 2 B per token per layer, 7/8 of it to other ranks, fwd + bwd
    assert all_to_all_bytes(shape, 8192, 8, "bf16") == 2 * 32 * (1024 * 2 * 10240 * 7 // 8)
    assert all_to_all_bytes(shape, 8192, 1, "bf16") == 0


def test_the_card_and_the_banner_count_data_parallel_ranks_under_sequence_parallelism():
    from hf_zero3.checkpoint.card import hyperparameters
    from hf_zero3.job.facts import RunFacts

    rows = hyperparameters({"per_device_train_batch_size": 1, "gradient_accumulation_steps": 2,
                            "sequence_parallel_size": 4}, world_size=8, ds_config=None)
    assert rows["sequence_parallel_size"] == 4 and rows["total_train_batch_size"] == 4  # 1 x 2 x (8 / 4)
    assert "sequence_parallel_size" not in hyperparameters({}, world_size=8, ds_config=None)
    facts = RunFacts.from_values({"sequence_parallel_size": 4, "per_device_train_batch_size": 1,
                                  "gradient_accumulation_steps": 2})
    assert facts.describe(8).endswith("x 2 data-parallel ranks (8 ranks / sequence parallel 4) = global batch 4")


def test_plan_seq_len_names_the_sequence_parallel_size_and_tiling_that_fit(capsys):
    from hf_zero3.cli import main

    node = ["plan", "--model", "meta-llama/Meta-Llama-3-8B", "--gpu-mem", "80GB", "--host-ram", "2TB"]
    assert main([*node, "--gpus", "2", "--seq-len", "393216"]) == 0
    out = capsys.readouterr().out
    assert "length    sequence_parallel_size 2, tiled_compute true (196608 tokens per rank), all-to-all" in out, out
    assert "--sequence_parallel_size 2" in out and "--tiled_compute true" in out
    assert main([*node, "--gpus", "1", "--seq-len", "4194304"]) == 1
    assert "length    nothing fits 4194304 tokens on 1 GPU(s)" in capsys.readouterr().out


def test_packed_rows_flattened_for_flash_attention_take_micro_batch_1_under_sequence_parallelism():
    import types

    from hf_zero3.job.arguments import UsageError

    model = _tiny()
    model.config._attn_implementation = "flash_attention_2"  # what a GPU run loads; the check reads only the name
    args = types.SimpleNamespace(sequence_parallel_size=2, per_device_train_batch_size=4)
    with pytest.raises(UsageError) as error:
        sequence_parallel.prepare(model, args, packed=True)
    error_naming(str(error.value), "flattened", "set per_device_train_batch_size 1")


@pytest.mark.usefixtures("single_rank_env")
def test_train_refuses_a_bad_sequence_parallel_run_before_start_naming_each_fix(capsys, tmp_path):
    from hf_zero3.run.train import main
    from tests.conftest import TINY_YAML

    assert main([str(TINY_YAML), "--max_steps", "1", "--sequence_parallel_size", "2", "--block_size", "127",
                 "--attn_implementation", "eager", "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    error_naming(err, "world size 1", "launch a multiple of 2 ranks")
    error_naming(err, "block_size 127", "multiple of 2")
    error_naming(err, "attn_implementation eager", "set attn_implementation sdpa")
    assert not (tmp_path / "o").exists()


def test_the_oom_advice_answers_a_length_that_does_not_fit_with_tiling_or_sequence_parallelism():
    from hf_zero3.config.presets import STANDALONE_CONFIGS
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.advice import oom_advice
    from hf_zero3.plan.length import per_rank
    from hf_zero3.plan.memory import plan
    from hf_zero3.plan.types import Hardware, Training
    from hf_zero3.units import GB, gb

    shape, long = _llama8b(), Training(393216)
    frugal = ZeroSpec(**{**STANDALONE_CONFIGS["zero3_offload_optimizer"].model_dump(exclude_unset=True),
                         "activation_checkpointing": True, "activation_offload": True})
    one = oom_advice(shape, Hardware(1, 1, 141 * GB, 2000 * GB), long, frugal)
    assert "The sequence (393216 tokens) is what does not fit" in one and "--tiled_compute true" in one
    assert "--sequence_parallel_size" not in one
    two = oom_advice(shape, Hardware(1, 2, 80 * GB, 2000 * GB), long, ZeroSpec(stage=3, activation_checkpointing=True))
    assert "--sequence_parallel_size 2; --tiled_compute true" in two and "2x the accumulation" in two
    # a run with sequence parallelism is planned at its share of each sequence, and only more of it is offered
    node = Hardware(1, 2, 80 * GB, 2000 * GB)
    shared = oom_advice(shape, node, long, frugal, sequence_parallel=2)
    assert f"Planned for this run: {gb(plan(shape, node, per_rank(long, 2, False), frugal).gpu_bytes)}" in shared
    assert "--tiled_compute true" in shared and "--sequence_parallel_size" not in shared
    from hf_zero3.plan.preference import preference_of

    pairs = oom_advice(shape, node, Training(393216, preference=preference_of("dpo")), frugal)
    assert "--sequence_parallel_size" not in pairs  # sequence parallelism runs SFT only
    pairs = oom_advice(shape, Hardware(1, 1, 141 * GB, 2000 * GB), Training(196608, preference=preference_of("dpo")),
                       frugal)
    assert "The sequence (196608 tokens) is what does not fit" in pairs and pairs.endswith("--tiled_compute true")


def test_the_oom_advice_of_a_run_plans_its_sequence_parallelism_and_tiling(monkeypatch):
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from hf_zero3.config.build import build_ds_config
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.types import Hardware
    from hf_zero3.run.oom import oom_advice_for_run
    from hf_zero3.units import GB

    config = LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    args = SimpleNamespace(hf_deepspeed_config=SimpleNamespace(config=build_ds_config(ZeroSpec(stage=3))),
                           deepspeed="ds.json", bf16=True, fp16=False, gradient_checkpointing=True, world_size=2,
                           per_device_train_batch_size=1, gradient_accumulation_steps=1)
    node = Hardware(1, 2, 80 * GB, 2000 * GB)
    plain = oom_advice_for_run(config, args, 65536, hardware=node)
    shared = oom_advice_for_run(config, SimpleNamespace(**vars(args), sequence_parallel_size=2, tiled_compute=True),
                                65536, hardware=node)
    planned = lambda text: float(text.split("Planned for this run: ")[1].split(" GB")[0].replace(",", ""))
    assert planned(plain) - planned(shared) > 25  # one rank's 32768 tokens of checkpoints and recompute, MLPs tiled


def test_the_oom_advice_of_a_length_scales_the_accumulation_from_the_runs_own_sequence_parallelism():
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.advice import oom_advice
    from hf_zero3.plan.types import Hardware, Training
    from hf_zero3.units import GB

    node = Hardware(1, 8, 80 * GB, 2000 * GB)  # sp 2 -> 8: 4 data-parallel ranks become 1, 4x the accumulation
    advice = oom_advice(_llama8b(), node, Training(1572864, 1, 2), ZeroSpec(stage=3, activation_checkpointing=True),
                        sequence_parallel=2)
    assert "--sequence_parallel_size 8" in advice and "4x the accumulation" in advice
    assert "--gradient_accumulation_steps 8 (same global batch)" in advice
    assert "--per_device_train_batch_size" not in advice


def test_the_oom_advice_of_a_length_moves_a_larger_micro_batch_to_the_one_it_predicts():
    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.advice import oom_advice
    from hf_zero3.plan.types import Hardware, Training
    from hf_zero3.units import GB

    # micro 2 x accumulation 3 on 2 GPUs (global 12) -> sp 2 at micro 1 (the prediction's): 1 x 12 x 1 rank
    advice = oom_advice(_llama8b(), Hardware(1, 2, 80 * GB, 2000 * GB), Training(393216, 2, 3),
                        ZeroSpec(stage=3, activation_checkpointing=True))
    assert "--sequence_parallel_size 2" in advice
    assert "--per_device_train_batch_size 1 --gradient_accumulation_steps 12 (same global batch" in advice
