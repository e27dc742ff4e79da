"""TRL's `SFTTrainer`, set up from our arguments and the examples `data.build` prepared.

The examples arrive tokenized, with their labels (-100 where nothing is trained), already checked, fitted to
block_size and mixed. TRL does the rest the way it does for its own users: packs them best-fit into block_size rows
(`pack_dataset`, strategy bfd) and flattens each micro batch into one row with position_ids restarting per example,
or pads one example per row; computes the loss through its chunked LM head (the full logits are never built) and
logs the token accuracy and entropy of the trained tokens. Raw text arrives as full blocks and is batched as is.

On CPU the head scores only the trained positions, as TRL does on GPUs (`score_trained_positions_only`).
"""

from __future__ import annotations

import dataclasses
import functools

import trl.trainer.utils
from trl import SFTConfig, SFTTrainer
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from hf_zero3.data.build import PACKED, Prepared
from hf_zero3.data.packing import attention_of, flattens, packing_problem
from hf_zero3.job.arguments import TrainingArguments


@dataclasses.dataclass
class SFTTrainingArguments(TrainingArguments, SFTConfig):
    """Our TrainingArguments with SFTConfig's fields too: what SFTTrainer reads its settings from. Never parsed
    (the data's layout sets TRL's fields, `as_sft_config`); a class of this module so checkpoints can pickle it."""


def as_sft_config(training_args: TrainingArguments, data_args, layout: str) -> SFTTrainingArguments:
    """The run's TrainingArguments read by SFTTrainer as an SFTConfig, in place: the object the DeepSpeed bridge and
    our callbacks already hold stays the one the trainer uses (SFTTrainer would otherwise rebuild its own from
    `to_dict()`, which knows nothing of our fields). TRL's own fields take their defaults, then the data's layout."""
    mine = set(vars(training_args))
    training_args.__class__ = SFTTrainingArguments
    for f in dataclasses.fields(SFTConfig):
        if f.name not in mine:
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            setattr(training_args, f.name, default)
    # SFTConfig's "auto" is resolved in its __post_init__ (None off Neuron); under sequence parallelism each sequence
    # splits into equal shards, so TRL's collator pads it to a multiple of the group
    sp = getattr(training_args, "sequence_parallel_size", 1)
    training_args.pad_to_multiple_of = sp if sp > 1 else None
    training_args.max_length = data_args.block_size
    training_args.packing = layout == PACKED
    training_args.packing_strategy = "bfd"
    training_args.dataset_num_proc = data_args.preprocessing_num_workers
    return training_args


class PackedRows(DataCollatorForLanguageModeling):
    """TRL's collator with each packed row kept a row of the batch: position_ids restarting per example and no
    attention mask, from which transformers builds SDPA's and eager attention's block-diagonal mask. TRL flattens the
    micro batch into one row, right for flash attention's varlen kernels; without them one row of B x L tokens
    costs (B x L)^2 attention where B rows cost B x L^2 (on the tiny recipe's CPU chat run, 2.5x the step time)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None):
        super().__init__(pad_token_id=pad_token_id, padding_free=False, return_position_ids=True,
                         pad_to_multiple_of=pad_to_multiple_of)

    def torch_call(self, examples: list[dict]) -> dict:
        batch = super().torch_call(examples)
        del batch["attention_mask"]  # with one, transformers would not read the examples' bounds from position_ids
        return batch


def packing_refusal(model) -> str | None:
    """Why packed rows would cross-talk in this model (a LoRA run: the model peft wraps); None when they would not."""
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    return packing_problem(type(base), attention_of(base))


def _compacts(trls_rule, device) -> bool:
    """Where TRL's chunked LM head scores only the positions with a label: TRL's rule (Triton devices; elsewhere it
    scores every position, so that Neuron's compiled tiles keep one shape), and the CPU."""
    return device.type == "cpu" or trls_rule(device)


def score_trained_positions_only(main_process: bool = True) -> None:
    """TRL's chunked LM head on CPU (which compiles nothing) scores only the trained positions too: scoring all of
    them cost the tiny recipe's chat run (a fifth of its tokens trained) a quarter of its step time. The same
    log-probabilities, loss, entropy and accuracy; the head's weight gradient sums fewer zero rows (its last bits
    may differ). The hook is TRL's private `_use_triton`: where a TRL has none, the run goes on and says so."""
    trls_rule = getattr(trl.trainer.utils, "_use_triton", None)
    if trls_rule is None:
        if main_process:
            print("hf_zero3: this TRL has no trl.trainer.utils._use_triton, the hook that lets its LM head score only "
                  "the trained positions: on CPU it scores every position (slower, the same loss)", flush=True)
        return
    if not isinstance(trls_rule, functools.partial) or trls_rule.func is not _compacts:
        trl.trainer.utils._use_triton = functools.partial(_compacts, trls_rule)


def sft_trainer(model, training_args, data_args, prepared: Prepared, tokenizer):
    """SFTTrainer over the prepared data; TRL's refusals (a Liger loss it cannot use, ...) as ValueError."""
    if prepared.layout == PACKED and (problem := packing_refusal(model)):
        raise ValueError(problem)
    args = as_sft_config(training_args, data_args, prepared.layout)
    score_trained_positions_only(args.process_index == 0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=prepared.train, eval_dataset=prepared.eval,
                         processing_class=tokenizer)
    base = model.get_base_model() if hasattr(model, "peft_config") else model
    if prepared.layout == PACKED and not flattens(attention_of(base)):
        trainer.data_collator = PackedRows(trainer.data_collator.pad_token_id, args.pad_to_multiple_of)
    return trainer


def rows_note(prepared: Prepared, trainer, block_size: int) -> str:
    """What the train rows are made of, once TRL has packed them."""
    rows = len(trainer.train_dataset)
    if prepared.layout != PACKED:
        return f"{rows} train rows of {prepared.tokens / max(rows, 1):.0f} tokens on average"
    return (f"{rows} packed train rows of {block_size} tokens: {prepared.tokens} tokens "
            f"({prepared.tokens / max(rows, 1) / block_size:.1%} of their room, the rest padding)")
