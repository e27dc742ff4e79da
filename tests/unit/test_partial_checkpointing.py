"""Checkpointing only the first N layers: which layers recompute, the same numbers as full checkpointing, and the
option through `hf-zero3 train` (a real single-rank Trainer run on CPU)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import TrainerCallback

from hf_zero3.callbacks.partial_checkpointing import checkpoint_first
from hf_zero3.model.layers import checkpointing_layers
from hf_zero3.run.train import main
from tests.conftest import ROOT, TINY_YAML, error_naming


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model")).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class MlpCalls:
    """How many times each layer's MLP ran: twice in a step where the layer is recomputed in backward."""

    def __init__(self, model):
        layers = checkpointing_layers(model)
        self.calls = [0] * len(layers)
        for i, layer in enumerate(layers):  # the forward itself: module hooks do not fire in torch's recompute
            layer.mlp.forward = self._counted(i, layer.mlp.forward)

    def _counted(self, i, forward):
        def counted(*args, **kwargs):
            self.calls[i] += 1
            return forward(*args, **kwargs)
        return counted


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("count", [1, 3, 4])
def test_only_the_first_layers_recompute_and_the_numbers_do_not_change(tiny, count):
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(1))
    full, partial = copy.deepcopy(tiny), copy.deepcopy(tiny)
    assert checkpoint_first(partial, count) == 4 - count
    calls = MlpCalls(partial)
    (la, ga), (lb, gb) = _step(full, ids), _step(partial, ids)
    assert calls.calls == [2] * count + [1] * (4 - count)
    assert torch.equal(la, lb) and all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("count", [0, 5, -1])
def test_a_count_outside_the_layers_names_the_range(tiny, count):
    with pytest.raises(ValueError, match="set it between 1 and 4"):
        checkpoint_first(copy.deepcopy(tiny), count)


@pytest.mark.usefixtures("single_rank_env")
def test_the_train_option_keeps_the_last_layers_out_of_checkpointing(tmp_path, capsys):
    counted = {}

    class Probe(TrainerCallback):  # runs after ours: sees the layers as training runs them
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            counted["calls"] = MlpCalls(model)
            counted["flags"] = [layer.gradient_checkpointing for layer in checkpointing_layers(model)]

    out = tmp_path / "out"
    assert main([str(TINY_YAML), "--deepspeed", "null", "--max_steps", "2", "--logging_steps", "1",
                 "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--save_strategy", "no",
                 "--validation_file", "null", "--save_final_model", "false", "--output_dir", str(out),
                 "--gradient_checkpointing", "true", "--gradient_checkpointing_layers", "3"],
                extra_callbacks=[Probe()]) == 0
    error_naming(capsys.readouterr().out, "activation checkpointing", "first 3 layers", "last 1")
    assert counted["flags"] == [True, True, True, False]
    assert counted["calls"].calls == [4, 4, 4, 2]  # 2 steps: forward + recompute, against forward only
    record = json.loads((out / "run_config.json").read_text())
    assert record["training"]["gradient_checkpointing_layers"] == 3


@pytest.mark.usefixtures("single_rank_env")
@pytest.mark.parametrize("flags, message", [
    (["--gradient_checkpointing_layers", "2"], "needs gradient_checkpointing true"),
    (["--gradient_checkpointing", "true", "--gradient_checkpointing_layers", "0"], "must be >= 1"),
    (["--gradient_checkpointing", "true", "--gradient_checkpointing_layers", "9"],
     "has 4 checkpointable layers: set it between 1 and 4"),
])
def test_bad_counts_are_usage_errors_before_training(tmp_path, capsys, flags, message):
    out = tmp_path / "out"
    assert main([str(TINY_YAML), "--deepspeed", "null", "--max_steps", "1", "--output_dir", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (out / "train_log.jsonl").exists()
