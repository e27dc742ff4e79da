"""Activation offload under real 2-rank ZeRO-3 on CPU: the same losses, gradients and weights as without it, and
host memory holding the activation bytes the planner plans for."""

from __future__ import annotations

import json

import pytest
import torch

from hf_zero3.job.distributed import free_port
from tests.conftest import ROOT, TINY_YAML, explain, run, train_log, weights

pytestmark = pytest.mark.integration

STEPS = 10
COMMON = ["--max_steps", str(STEPS), "--logging_steps", "1", "--save_strategy", "no", "--validation_file", "null",
          "--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs", '{"use_reentrant": false}']


def _train(tmp_path, name: str, *extra) -> tuple:
    out, probe = tmp_path / name, tmp_path / f"{name}-probe"
    proc = run(["deepspeed", "--num_gpus", "2", "--master_port", free_port(), "tests/integration/offload_probe.py",
                probe, TINY_YAML, "--output_dir", out, *COMMON, *extra])
    assert proc.returncode == 0, explain(proc)
    return proc, out, probe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    config = json.loads((ROOT / "recipes/tiny/ds_config.json").read_text())
    config["activation_checkpointing"] = {"cpu_checkpointing": True}  # the seed's way of asking for it
    (tmp / "ds_offload.json").write_text(json.dumps(config))
    return _train(tmp, "plain"), _train(tmp, "offload", "--deepspeed", tmp / "ds_offload.json")


def test_cpu_checkpointing_in_the_ds_config_switches_offload_on(runs):
    (plain, _, plain_probe), (offload, _, _) = runs
    assert "activation offload on (ds_config activation_checkpointing.cpu_checkpointing)" in offload.stdout
    assert "activation offload on" not in plain.stdout
    assert all(json.loads(line) == {"step": i + 1, "offloader": None}
               for i, line in enumerate((plain_probe / "rank0.jsonl").read_text().splitlines()))


def test_losses_gradients_and_weights_are_identical_with_offload(runs):
    (_, plain, _), (_, offload, _) = runs
    a, b = train_log(plain), train_log(offload)
    steps = lambda log, key: [r[key] for r in log if key in r and "train_runtime" not in r]
    assert len(steps(a, "loss")) == STEPS
    assert steps(a, "loss") == steps(b, "loss")  # fp32, bit for bit
    assert steps(a, "grad_norm") == steps(b, "grad_norm")
    wa, wb = weights(plain), weights(offload)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_host_memory_holds_the_planned_activation_bytes(runs):
    from transformers import AutoConfig

    from hf_zero3.config.spec import ZeroSpec
    from hf_zero3.plan.memory import plan
    from hf_zero3.plan.shapes import shape_from_config
    from hf_zero3.plan.types import Hardware, Training

    (_, _, _), (_, _, probe) = runs
    shape = shape_from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model"))
    planned = plan(shape, Hardware(1, 2, 80 * 10**9, None), Training(128, 8),
                   ZeroSpec(precision="fp32", activation_checkpointing=True, activation_offload=True))
    host = {t.name: t.bytes for t in planned.breakdown["host"]}["activations offloaded (pinned)"] / 2  # per rank
    layers_only = 4 * 8 * 128 * 128 * 4  # 4 layer inputs of 8 x 128 tokens x 128 hidden x fp32
    for rank in (0, 1):
        records = [json.loads(line) for line in (probe / f"rank{rank}.jsonl").read_text().splitlines()]
        assert len(records) == STEPS
        for r in records:
            # Each step stashes the 4 checkpointed layer inputs and the final norm's 2 saved tensors, and frees them
            # all in backward. The planner's final-norm figure counts an fp32 copy that fp32 training does not make,
            # so it plans a little more than is stashed.
            assert r["bytes"] == r["peak_host_bytes"] == layers_only + 2 * 8 * 128 * 128 * 4, r
            assert 0.8 * host <= r["peak_host_bytes"] <= host, (r, host)
            assert r["host_bytes"] == 0 and r["tensors"] == 6
