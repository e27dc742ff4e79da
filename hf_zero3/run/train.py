"""`hf-zero3 train CONFIG.yaml [--key value ...]` (also `python -m hf_zero3.train`): TRL's SFTTrainer, set up right.

One HfArgumentParser over (ModelArguments, DataArguments, TrainingArguments) (`job.arguments`); every input checked
before anything starts (`run.checks`); where the run starts, resume included (`run.start`). TrainingArguments (and
with it the DeepSpeed config) exist before the model, so ZeRO-3 partitions the weights while they load. No training
loop of our own: TRL's `SFTTrainer` (a `transformers.Trainer` on the same DeepSpeed bridge, `run.sft`) plus our
callbacks.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_zero3.callbacks import (
    DeepSpeedTimersCallback,
    HubPushCallback,
    NvmeResumeCallback,
    ThroughputCallback,
    default_callbacks,
    install_callbacks,
)
from hf_zero3.callbacks.adapter_check import verify_on_all_ranks as verify_adapter_on_all_ranks
from hf_zero3.callbacks.nonfinite_guard import NonFiniteError
from hf_zero3.callbacks.partial_checkpointing import PartialCheckpointingCallback
from hf_zero3.callbacks.preemption import Preempted, PreemptionCallback, release_all
from hf_zero3.checkpoint import contents
from hf_zero3.checkpoint.export import generation_ready
from hf_zero3.checkpoint.lifecycle import CheckpointError, newest_complete, weights_gathered, write_finished
from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.errors import DataError
from hf_zero3.job.arguments import (
    ArgumentParser,
    ModelArguments,
    TrainingArguments,
    UsageError,
    load_arguments,
)
from hf_zero3.job.distributed import (
    LaunchError,
    cuda_available,
    is_world_process_zero,
    prepare_process_group,
    process_group_released,
    release_engine,
)
from hf_zero3.job.facts import RunFacts, ds_config_of
from hf_zero3.job.preemption import PREEMPTED_EXIT
from hf_zero3.model import lora, prepare
from hf_zero3.model.layers import checked_layers
from hf_zero3.plan.hardware import gpu_name
from hf_zero3.plan.types import Adapter
from hf_zero3.run import sequence_parallel
from hf_zero3.run.checks import check_inputs, training_values
from hf_zero3.run.node_loss import PEER_LOST_EXIT, USAGE_EXIT, peer_lost
from hf_zero3.run.oom import oom_advice_for_run, oom_kind
from hf_zero3.run.plots import plot_train_log
from hf_zero3.run.stages import stage_of
from hf_zero3.run.start import FINISHED, claim, start_point


def _load_model_and_tokenizer(model_args: ModelArguments, resume: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source = model_args.model_name_or_path or model_args.config_name  # checked by run.checks
    common = {"trust_remote_code": model_args.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(source, **common)
        tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or source, **common)
    except (OSError, ValueError) as e:  # hub ids offline, configs or tokenizers transformers cannot read
        raise UsageError(f"could not load {source}: {e}. Use a local folder, or a hub id with network access "
                         "(or a filled HF cache)") from e
    if model_args.config_overrides:
        try:
            config.update_from_string(model_args.config_overrides)
        except ValueError as e:  # a key the config does not have, a value of the wrong type
            raise UsageError(f"config_overrides {model_args.config_overrides!r}: {e}. Use key=value pairs, comma "
                             f"separated, with keys of {source}'s config.json") from e
    if resume and (differences := contents.shape_difference(resume, config)):
        raise UsageError(f"{resume} holds a model of another shape than this run's: {'; '.join(differences)}. Resume "
                         "with the model it was saved from (the model_name_or_path or config_name and config_overrides "
                         f"of that run: its config is {resume}/config.json), or train this model in another output_dir")
    if len(tokenizer) > config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
                         f"{config.vocab_size}: use the model's own tokenizer (tokenizer_name) or raise vocab_size "
                         "(config_overrides: vocab_size=N when training from scratch)")
    config.use_cache = False  # the KV cache is for generation; training only pays for it
    kwargs = {**common}
    if model_args.attn_implementation:
        kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.model_name_or_path:
        if model_args.dtype:
            kwargs["dtype"] = model_args.dtype
        try:
            model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, config=config, **kwargs)
        except OSError as e:  # weights missing or unreadable
            raise UsageError(f"could not load the weights of {model_args.model_name_or_path}: {e}") from e
        except (ValueError, ImportError) as e:  # an attn_implementation that is unknown or not installed
            raise UsageError(f"could not build the model of {source}: {e}") from e
    else:
        try:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        except (ValueError, ImportError) as e:
            raise UsageError(f"could not build the model of {source}: {e}") from e
    return model, tokenizer


def _banner(trainer) -> str:
    args = trainer.args
    ds = ds_config_of(args)
    stage = ds.get("zero_optimization", {}).get("stage", 0) if ds else "off (no deepspeed config)"
    facts = RunFacts.from_args(args, seq_len=0)
    return (f"hf_zero3: ZeRO stage {stage} | world size {args.world_size} | {facts.describe(args.world_size)} | "
            f"{facts.precision} | device {args.device}")


def _explain_oom(error: BaseException, model_config, training_args, seq_len: int,
                 adapter: Adapter | None = None) -> None:
    """On an out-of-memory error, print the planner's next step as exact overrides (then the error is re-raised).
    `adapter`: a LoRA run's adapter (`model.lora.planned_adapter`)."""
    kind = oom_kind(error)
    if kind is None:
        return
    try:
        advice = oom_advice_for_run(model_config, training_args, seq_len, host=kind == "host", adapter=adapter)
    except Exception as planner_error:  # noqa: BLE001 -- never hide the OOM behind a planner problem
        advice = f"(the planner could not suggest a next step: {planner_error})"
    print(f"[rank {os.environ.get('RANK', '0')}] hf_zero3: out of {'host' if kind == 'host' else 'GPU'} memory. "
          f"{advice}", file=sys.stderr, flush=True)


def _partial_checkpointing(model, training_args) -> list:
    """The callback that checkpoints only the first `gradient_checkpointing_layers` layers, checked against the
    model's layer count before anything starts; none when the option is unset."""
    if training_args.gradient_checkpointing_layers is None:
        return []
    checked_layers(model, training_args.gradient_checkpointing_layers)
    return [PartialCheckpointingCallback(training_args.gradient_checkpointing_layers)]


def write_run_config(path: Path, model_args, data_args, trainer, by_callbacks: dict[str, Any]) -> None:
    """The resolved arguments and the ds_config as the bridge filled it: what actually ran.

    `by_callbacks` holds the user's settings that our callbacks carry out while the Trainer's own copy is off
    (save_total_limit, push_to_hub): recorded as the user set them, so a rerun from this file does the same.
    """
    ds = ds_config_of(trainer.args)
    resolved = {"model": dataclasses.asdict(model_args), "data": dataclasses.asdict(data_args),
                "training": {**trainer.args.to_dict(), **by_callbacks}, "ds_config": ds,
                "world_size": trainer.args.world_size}
    path.write_text(json.dumps(resolved, indent=2, default=str) + "\n")


def _plot_line(out: Path, model_args, training_args) -> str:
    """train_log.png next to train_log.jsonl (loss, throughput, memory per step); the line that says where."""
    model = Path(model_args.model_name_or_path or model_args.config_name or "model").name
    return plot_train_log(out, f"{model} ({out.name}): {training_args.world_size} x {gpu_name() or 'CPU'}")


def _checked_values(argv: list[str]) -> tuple[dict[str, Any], bool]:
    """The arguments as one dict, every input checked before anything starts; whether the run is on CPU."""
    values = load_arguments(argv)
    on_cpu = bool(values.get("use_cpu")) or not cuda_available()
    if on_cpu:
        values["use_cpu"] = True
        if values.get("use_liger_kernel"):  # Liger's kernels are Triton GPU kernels; the same recipe runs on CPU
            print("hf_zero3: use_liger_kernel needs a GPU: off on CPU", flush=True)
            values["use_liger_kernel"] = False
    check_inputs(values, device="cpu" if on_cpu else "cuda")
    return values, on_cpu


def _prepared_model(model_args, training_args, resume: str | None):
    """The model (partitioned while it loads under ZeRO-3), its adapter and leaf modules, and the tokenizer."""
    model, tokenizer = _load_model_and_tokenizer(model_args, resume)
    return prepare.before_trainer(model, model_args, training_args), tokenizer


def _reference_model(model_args, training_args, policy):
    """A preference stage's reference model, prepared as the policy is: partitioned while it loads under ZeRO-3, the
    same attention kernel and `prepare.before_trainer` (its leaf modules); from a config, the policy's own random
    start (the same seed)."""
    from transformers import set_seed

    set_seed(training_args.seed)
    source = model_args.ref_model_name_or_path or model_args.model_name_or_path
    reference, _ = _load_model_and_tokenizer(dataclasses.replace(model_args, model_name_or_path=source, peft=None))
    return prepare.before_trainer(reference, dataclasses.replace(model_args, peft=None), training_args,
                                  who="reference model")


def _trainer(model, tokenizer, model_args, data_args, training_args, preemption, resume: str | None,
             extra_callbacks: Sequence[Any]):
    """TRL's SFTTrainer over the run's data, with our callbacks; what our callbacks carry out instead of the
    Trainer (recorded in run_config.json as the user set it); the prepared data."""
    from hf_zero3.data.build import build_datasets  # datasets takes a second (see run.checks)
    from hf_zero3.run.sft import (  # TRL takes seconds to import, once the inputs are known good
        rows_note,
        sft_trainer,
    )

    stage = stage_of({"stage": training_args.stage})
    if stage.columns is not None:  # a preference stage (hf_zero3/run/preference.py): TRL's trainer for it
        from hf_zero3.run.preference import build_data, preference_trainer
        prepared = build_data(stage, data_args, tokenizer, training_args)
    else:
        prepared = build_datasets(data_args, tokenizer, training_args,
                                  max_positions=model.config.max_position_embeddings,
                                  tokenizer_name=model_args.tokenizer_name or model_args.model_name_or_path
                                  or model_args.config_name)
    sequence_parallel.prepare(model, training_args, packed=prepared.layout == "packed")
    try:
        sources = {"base_model": model_args.model_name_or_path,
                   "datasets": [data_args.dataset_name] if data_args.dataset_name else []}
        callbacks = [preemption, *default_callbacks(training_args, seq_len=round(prepared.attended), sources=sources,
                                                    lora=model_args.peft is not None),
                     *_partial_checkpointing(model, training_args), *extra_callbacks]
    except (CheckpointError, ValueError) as e:  # e.g. push_to_hub without a usable hub_model_id, a negative patience
        raise UsageError(str(e)) from e
    # CheckpointGuardCallback rotates over complete checkpoints and HubPushCallback uploads exported weights (both
    # took these settings above): the Trainer's own rotation and push (which would create the Hub repo in its
    # __init__ and upload whatever save_model wrote), blind to incomplete saves, stay off.
    by_callbacks = {"save_total_limit": training_args.save_total_limit, "push_to_hub": training_args.push_to_hub}
    training_args.save_total_limit, training_args.push_to_hub = None, False
    try:
        trainer = sft_trainer(model, training_args, data_args, prepared, tokenizer) if stage.columns is None else \
            preference_trainer(stage, model, tokenizer, model_args, data_args, training_args, prepared,
                               lambda: _reference_model(model_args, training_args, model))
    except ValueError as e:  # packing that would cross-talk, a Liger loss TRL cannot use, ...
        raise UsageError(str(e)) from e
    sequence_parallel.shard_batches(trainer)
    if stage.columns is not None:  # the model card names the stage (each checkpoint's marker records it)
        sources["stage"] = trainer.stage_description
    for callback in callbacks:  # the real tokens of a row, known once TRL has packed them
        if isinstance(callback, ThroughputCallback):
            callback.tokens_per_sample = prepared.tokens / max(len(trainer.train_dataset), 1)
    if is_world_process_zero():
        for note in [*prepared.notes, *([rows_note(prepared, trainer, data_args.block_size)] if stage.columns is None
                                        else [])]:
            print(f"hf_zero3: data: {note}", flush=True)
    sequence_parallel.resumable(trainer)
    prepare.after_trainer(model, training_args)  # after the Trainer: Liger patches forwards in its __init__
    install_callbacks(trainer, [DeepSpeedTimersCallback(trainer), NvmeResumeCallback(trainer, resume), *callbacks])
    return trainer, by_callbacks, prepared


def _trained(trainer, model, training_args, data_args, resume, preemption) -> dict[str, float]:
    """Train; the planner's advice on an out-of-memory error; a preempted run stopped at its checkpoint."""
    if trainer.is_world_process_zero():
        print(_banner(trainer), flush=True)
        if training_args.stage != "sft":
            from hf_zero3.run.preference import stage_banner
            print(stage_banner(trainer), flush=True)
    try:
        result = trainer.train(resume_from_checkpoint=resume)
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        _explain_oom(error, model.config, training_args, data_args.block_size, lora.planned_adapter(model))
        raise
    if preemption.stopped_at is not None:  # a checkpoint, no final model: the run is not finished
        stopped = preemption.outcome(training_args.output_dir)
        release_engine(trainer)
        raise stopped
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    return dict(result.metrics)


def _saved_and_evaluated(trainer, model, model_args, training_args, has_eval: bool) -> dict[str, float]:
    """The final model (verified, for a LoRA run), the trainer state, and the final evaluation's metrics."""
    if training_args.save_final_model:
        trainer.save_model()
        if model_args.peft is not None and (problems := verify_adapter_on_all_ranks(model, training_args.output_dir)):
            raise CheckpointError(f"the final adapter in {training_args.output_dir} is not the trained one: "
                                  f"{'; '.join(problems[:5])}. The run is not marked finished")
        if trainer.is_world_process_zero():  # the final model is for inference: KV cache back on
            generation_ready(Path(training_args.output_dir))
    trainer.save_state()
    if not has_eval:
        return {}
    eval_metrics = trainer.evaluate()
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    return eval_metrics


def _finished(trainer, model_args, data_args, training_args, by_callbacks, metrics: dict[str, float]) -> None:
    """Hub pushes waited for, run_config.json and the finished marker written, and where everything is said."""
    for callback in trainer.callback_handler.callbacks:  # pushes run in a thread on rank 0; collectives are done
        if isinstance(callback, HubPushCallback):
            callback.wait()
    out = Path(training_args.output_dir)
    progress = {"global_step": trainer.state.global_step, "max_steps": training_args.max_steps,
                "num_train_epochs": training_args.num_train_epochs}
    if not trainer.is_world_process_zero():
        if trainer.args.should_save:  # save_on_each_node: this node's copy of output_dir is finished too
            write_finished(out, progress)
        return
    write_run_config(out / "run_config.json", model_args, data_args, trainer, by_callbacks)
    shards = training_args.save_final_model and model_args.peft is None and not weights_gathered(
        ds_config_of(trainer.args))
    write_finished(out, {**progress, **({"zero_shards": (out / "latest").read_text().strip()} if shards else {})})
    newest = newest_complete(out)
    if shards:
        print(f"hf_zero3: final model: ZeRO shards in {out} (stage3_gather_16bit_weights_on_model_save is off, "
              f"which keeps a 16-bit copy of the model out of rank 0's host RAM); a Hugging Face folder: "
              f"hf-zero3 export {out} {out}-hf", flush=True)
    elif training_args.save_final_model:
        print(f"hf_zero3: final model: {out}", flush=True)
    if newest:
        print(f"hf_zero3: last checkpoint: {newest}", flush=True)
    print(f"hf_zero3: logs: {out / 'train_log.jsonl'} (and trainer_state.json)", flush=True)
    print(_plot_line(out, model_args, training_args), flush=True)
    print("hf_zero3: metrics: " + json.dumps({k: round(v, 4) for k, v in metrics.items()
                                               if isinstance(v, float)}), flush=True)


def run(argv: list[str], extra_callbacks: Sequence[Any] = ()) -> dict[str, float]:
    """Parse, set up, train, save; returns the final metrics. `extra_callbacks` go after ours (e.g. a probe)."""
    values, on_cpu = _checked_values(argv)
    from transformers import set_seed  # once the inputs are known good: the Trainer takes seconds to import

    prepare_process_group(on_cpu=on_cpu, use_deepspeed=bool(values.get("deepspeed")),
                          timeout_s=training_values(values)["ddp_timeout"])
    parser = ArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_dict(values, allow_extra_keys=False)
    preemption = PreemptionCallback(training_args.preemption_signals)  # before the model: loading takes long
    resume = start_point(training_args)
    if resume == FINISHED:
        return {}
    claim(training_args)
    set_seed(training_args.seed)  # before the model: every rank (and every run) starts from the same weights
    model, tokenizer = _prepared_model(model_args, training_args, resume)
    trainer, by_callbacks, prepared = _trainer(model, tokenizer, model_args, data_args, training_args, preemption,
                                               resume, extra_callbacks)
    metrics = _trained(trainer, model, training_args, data_args, resume, preemption)
    metrics.update(_saved_and_evaluated(trainer, model, model_args, training_args, prepared.eval is not None))
    _finished(trainer, model_args, data_args, training_args, by_callbacks, metrics)
    release_engine(trainer)  # its groups' threads end with the teardown, not in the interpreter's exit
    return metrics


ERROR_EXIT_DELAY_S = 5.0
"""After a usage error, ranks other than 0 wait this long before exiting. torchrun and the DeepSpeed launcher kill
every rank once the first one exits: were that not rank 0, its message (the only one) could be lost."""


def main(argv: list[str] | None = None, extra_callbacks: Sequence[Any] = ()) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        from transformers import HfArgumentParser

        print("usage: hf-zero3 train [CONFIG.yaml] [--key value ...]\n")
        HfArgumentParser((ModelArguments, DataArguments, TrainingArguments)).print_help()
        return 0
    try:
        with process_group_released(UsageError, DataError, LaunchError, Preempted):
            run(argv, extra_callbacks)
    except Preempted as e:
        if is_world_process_zero():
            print(f"hf_zero3: {e}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    except (UsageError, DataError, LaunchError) as e:
        if is_world_process_zero():
            print("error: " + str(e).replace("\n", "\nerror: "), file=sys.stderr, flush=True)
        else:
            time.sleep(ERROR_EXIT_DELAY_S)
        return USAGE_EXIT
    except (NonFiniteError, CheckpointError) as e:  # training stopped on purpose, the message says why and how on
        if is_world_process_zero():
            print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a collective lost a peer: one line instead of a traceback through DeepSpeed
        if (lost := peer_lost(e)) is None:
            raise
        print(f"hf_zero3: rank {os.environ.get('RANK', '?')}: lost contact with {lost}: that rank's process, its "
              f"node or the network to it stopped. Stopping (exit {PEER_LOST_EXIT}); the launcher names the node that "
              "failed. The same command with --resume_from_checkpoint auto resumes from the newest checkpoint "
              "complete on every node", file=sys.stderr, flush=True)
        return PEER_LOST_EXIT
    finally:
        release_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
