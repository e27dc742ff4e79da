"""Everything a run does to a model it trains, in one order that is code: `before_trainer` on each model the run
loads (the policy, and the reference model a preference stage brings), `after_trainer` on the policy once the
Trainer is built.

Why two phases: the Trainer applies Liger in its __init__, patching the decoder's forwards, and what wraps or traces
those forwards (activation offload, the tiles, FP8's casts, the compiled layers) must come after it; the adapter,
ZeRO-3's linear and the leaf modules must be in place before it (DeepSpeed partitions and hooks what it is given).
"""

from __future__ import annotations

from hf_zero3.job.arguments import UsageError
from hf_zero3.job.distributed import is_world_process_zero
from hf_zero3.job.facts import activation_offload_of, ds_config_of
from hf_zero3.model import activation_offload, experts, fp8, lora, regional_compile, tiled_compute


def before_trainer(model, model_args, training_args, who: str = ""):
    """The model as the Trainer must receive it: ZeRO-3's linear, the adapter (`peft`), the expert blocks as leaf
    modules, and Liger kept out of compiled layers; `who` names the model in the lines printed (the reference)."""
    if training_args.deepspeed:  # DeepSpeed's module is loaded by now: the import costs nothing here
        from hf_zero3.model import zero3_linear

        zero3_linear.install()  # where zero.Init put DeepSpeed's linear: a frozen weight's input is not kept
    if model_args.peft is not None:  # the adapter on the frozen base, partitioned with it when DeepSpeed starts
        try:
            model = lora.apply(model, lora.parse(model_args.peft), training_args)
        except ValueError as e:  # targets peft cannot adapt (checked before start where the config was at hand)
            raise UsageError(f"peft: {e}") from e
        if is_world_process_zero():
            print(lora.describe(model), flush=True)
    try:
        leaves = experts.set_leaf_modules(model, model_args.leaf_modules, training_args)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if leaves and is_world_process_zero():
        print(f"hf_zero3: {who + ': ' if who else ''}{leaves}", flush=True)
    _liger_outside_compiled_layers(training_args)
    return model


def after_trainer(model, training_args) -> None:
    """What wraps or traces the forwards the Trainer's __init__ patched (Liger), in this order."""
    _maybe_offload_activations(model, training_args)
    tiled_compute.enable_for_run(model, training_args)  # the tiles call Liger's forwards
    _maybe_fp8(model, training_args)  # before compiling: the compiled layers trace the float8 casts
    _maybe_compile_regions(model, training_args)  # the compiled layers trace Liger's forwards


def _liger_outside_compiled_layers(training_args) -> None:
    """With `regional_compile` and `use_liger_kernel` but no `liger_kernel_config`: none of Liger's kernels in the
    compiled layers (`regional_compile.LIGER_OUTSIDE_LAYERS`), set before the Trainer applies Liger in its __init__."""
    chosen = training_args.liger_kernel_config is not None
    if chosen or not (training_args.regional_compile and training_args.use_liger_kernel):
        return
    training_args.liger_kernel_config = dict(regional_compile.LIGER_OUTSIDE_LAYERS)
    if is_world_process_zero():
        print("hf_zero3: Liger with regional compile: none of its kernels, the compiler fuses the layers and TRL's "
              "chunked LM head computes the loss (liger_kernel_config chooses otherwise)", flush=True)


def _maybe_offload_activations(model, training_args) -> None:
    """Activation offload when asked by `activation_offload` or by the ds_config's `cpu_checkpointing`
    (`job.facts.activation_offload_of`, which the OOM advice and the launcher's plan ask too); the TrainingArguments
    field is set either way, so run_config.json records what ran."""
    ds = ds_config_of(training_args)
    by_ds = activation_offload_of(None, ds)
    if training_args.activation_offload is False and by_ds and is_world_process_zero():
        print("hf_zero3: activation offload off (activation_offload: false), although the ds_config's "
              "activation_checkpointing.cpu_checkpointing asks for it", flush=True)
    training_args.activation_offload = activation_offload_of(training_args.activation_offload, ds)
    if not training_args.activation_offload:
        return
    activation_offload.enable(model)
    if is_world_process_zero():
        why = "ds_config activation_checkpointing.cpu_checkpointing" if by_ds else "activation_offload"
        decoder = type(activation_offload.decoder_of(model)).__name__
        print(f"hf_zero3: activation offload on ({why}): what {decoder} saves for backward lives in host memory",
              flush=True)


def _maybe_fp8(model, training_args) -> None:
    """`fp8`: the decoder layers' linears swapped for torchao's Float8Linear (hf_zero3/model/fp8.py), before DeepSpeed
    wraps the model and its optimizer takes the (unchanged) parameters."""
    if not training_args.fp8:
        return
    try:
        converted = fp8.enable(model, training_args.fp8_recipe, emulate=training_args.use_cpu)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if is_world_process_zero():
        how = "emulated on CPU: float8 casts, fp32 matmuls" if training_args.use_cpu else "on FP8 tensor cores"
        print(f"hf_zero3: fp8 on: {len(converted)} linear layers of the decoder layers multiply in float8 (torchao, "
              f"{training_args.fp8_recipe} scaling; {how}); the embedding, lm_head and routers do not; MFU counts "
              "the same FLOPs against the bf16 peak", flush=True)


def _maybe_compile_regions(model, training_args) -> None:
    """`regional_compile`: each decoder layer compiled in place (hf_zero3/model/regional_compile.py), after the Trainer
    patched Liger's forwards in, before DeepSpeed wraps the model."""
    if not training_args.regional_compile:
        return
    try:
        layers = regional_compile.enable(model, training_args.regional_compile_backend)
    except ValueError as e:
        raise UsageError(str(e)) from e
    if is_world_process_zero():
        print(f"hf_zero3: regional compile on: {len(layers)} {type(layers[0]).__name__} blocks compiled in place "
              f"(backend {training_args.regional_compile_backend}); the embedding, lm_head and loss run uncompiled",
              flush=True)
