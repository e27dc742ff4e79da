"""From `DataArguments` to the train and eval datasets the Trainer batches, and how to batch them.

Raw text alone keeps the pre-training layout: documents joined with EOS, cut into full blocks by TRL's wrapped
packing, every token trained.
As soon as a source is chat or prompt/completion, every source becomes examples ({input_ids, labels}): rendered,
masked, checked against block_size (dropped or truncated, and counted) and mixed by weight or count. TRL's
`SFTTrainer` takes them from there: it packs them best-fit into block_size rows (or pads one per row) and batches
them (`run.sft`). Every step goes through `datasets.map`, so results are cached by fingerprint and built once, on
rank 0 first (the caller's `main_process_first`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import datasets
import pyarrow.compute as pc
from jinja2 import TemplateError, TemplateSyntaxError

from hf_zero3.data.arguments import DataArguments, DataSource, block_size_problem, sources_of
from hf_zero3.data.errors import DataError
from hf_zero3.data.formats import (ALPACA, ROLES, alpaca_row, as_messages, detect, messages_column_of, row_problems,
                                   tools_of)
from hf_zero3.data.loading import dataset_problem, file_problem, load_file, load_hub, load_source
from hf_zero3.data.tokenize import IGNORE, NotPrefixError, Tokenizer, chat_template_of
from hf_zero3.parsing import ParseError

BLOCKS_PER_BATCH = 64
"""Raw text is cut into blocks a map batch at a time, each batch's remainder dropped: at most 1/64 of the tokens."""

BLOCKS, PACKED, PADDED = "blocks", "packed", "padded"
"""How the train data is batched: full raw-text blocks, packed examples with position_ids, one example per row."""


@dataclass
class Prepared:
    """What the Trainer gets: the datasets, how to batch them, and what the run should say about them."""

    train: datasets.Dataset
    eval: datasets.Dataset | None
    layout: str
    tokens: int
    """Real (not padding) train tokens: divided by the rows TRL makes of them, what a step's token count is made of."""
    attended: float
    """Token-weighted mean length of the sequences tokens attend within (the S of 12·L·H·S attention FLOPs)."""
    notes: list[str] = field(default_factory=list)
    trained: int = 0
    """Train tokens with a label (what the loss is on)."""
    dropped: int = 0
    """Train examples dropped: longer than block_size (overlong: drop), or with no trained token."""


def _what(data_args: DataArguments, i: int) -> str:
    return f"datasets[{i}]" if data_args.datasets is not None else \
        ("train_file" if data_args.train_file else "dataset_name")


def _formats_and_rows(data_args: DataArguments) -> list[tuple[DataSource, str, datasets.Dataset]]:
    """Every training source loaded, its format found and every row checked."""
    loaded = []
    for i, source in enumerate(sources_of(data_args)):
        what = _what(data_args, i)
        rows = load_source(source, what)
        fmt = detect(rows.column_names, source, what)
        row_problems(rows, fmt, source, what, need_assistant=not data_args.train_on_inputs)
        loaded.append((source, fmt, rows))
    return loaded


def _validation_rows(data_args: DataArguments) -> tuple[DataSource, str, datasets.Dataset] | None:
    """The validation file, or the Hub dataset's own validation split, with its format; None if neither."""
    columns = {k: getattr(data_args, k) for k in ("text_column", "messages_column", "prompt_column",
                                                 "completion_column")}
    fmt = data_args.data_format if data_args.datasets is None else "auto"
    if data_args.validation_file:
        source = DataSource(path=data_args.validation_file, format=fmt, **columns)
        rows = load_file(data_args.validation_file, "validation_file")
        what = "validation_file"
    elif data_args.dataset_name and data_args.datasets is None:
        splits = load_hub(data_args.dataset_name, data_args.dataset_config_name)
        if "validation" not in splits:
            return None
        source = DataSource(name=data_args.dataset_name, config=data_args.dataset_config_name, split="validation",
                            format=fmt, **columns)
        rows, what = splits["validation"], "dataset_name"
    else:
        return None
    found = detect(rows.column_names, source, what)
    row_problems(rows, found, source, what, need_assistant=not data_args.train_on_inputs)
    return source, found, rows


def _validation_problem(formats: set[str], validation) -> str | None:
    """Raw text evaluated against chat or prompt/completion training (or the other way round) measures a loss the
    run does not train: refused, naming the way out."""
    if validation is None or (validation[1] == "text") == (formats == {"text"}):
        return None
    trained = "raw text" if formats == {"text"} else " and ".join(sorted(formats - {"text"}))
    return (f"validation_file {validation[0].label!r} is {'raw text' if validation[1] == 'text' else validation[1]} "
            f"but the training data is {trained}, so its eval loss would measure something the run does not train: "
            "give a validation_file of the training data's format, or set validation_file to null (with "
            "validation_split_percentage to hold out training rows instead).")


def _tokenizer_for(data_args: DataArguments, tokenizer, tokenizer_name: str, formats: set[str]) -> Tokenizer:
    """Chat needs a template (the user's or the tokenizer's); prompt/completion uses one only for conversational
    rows, and says so when it has none."""
    if "chat" in formats or data_args.chat_template:
        template = chat_template_of(tokenizer, data_args.chat_template, tokenizer_name)
    else:
        template = getattr(tokenizer, "chat_template", None)
        template = template.get("default") if isinstance(template, dict) else template
    return Tokenizer(tokenizer, template, train_on_inputs=data_args.train_on_inputs)


def _examples_fn(tok: Tokenizer, source: DataSource, fmt: str, columns: list[str], block_size: int, label: str):
    """A batched `datasets.map` function: rows of `fmt` -> examples {input_ids, labels}."""
    chat_column = messages_column_of(columns, source)
    tools_column = "tools" if "tools" in columns else None

    def to_examples(batch, indices):
        out = {"input_ids": [], "labels": [], "length": [], "trained": []}
        tools = batch[tools_column] if tools_column else [None] * len(indices)
        for k, row in enumerate(indices):
            try:
                if fmt == "chat":
                    examples = tok.chat_examples(batch[chat_column][k], tools_of(tools[k]))
                elif fmt == "alpaca":
                    examples = [tok.prompt_completion(*alpaca_row(batch[ALPACA[0]][k], batch.get(ALPACA[1], [None] * (
                        k + 1))[k], batch[ALPACA[2]][k], conversational=bool(tok.template)))]
                elif fmt == "prompt_completion":
                    examples = [tok.prompt_completion(batch[source.prompt_column][k],
                                                      batch[source.completion_column][k], tools_of(tools[k]))]
                else:
                    text = batch[source.text_column][k]
                    examples = tok.document(text, block_size) if text and not text.isspace() else []
            except (NotPrefixError, ParseError) as e:
                raise DataError(f"{label}, row {row + 1}: {e}") from None
            except TemplateSyntaxError as e:  # the template, not the row
                raise DataError(f"the chat template does not parse: line {e.lineno}: {e.message}. Fix the template "
                                "(chat_template: a .jinja file or the template text), or drop chat_template to use "
                                "the tokenizer's own") from None
            except TemplateError as e:
                raise DataError(f"{label}, row {row + 1}: the chat template cannot render it ({e}). Fix the row, "
                                "or set chat_template to a template that knows its roles.") from None
            for example in examples:
                out["input_ids"].append(example["input_ids"])
                out["labels"].append(example["labels"])
                out["length"].append(len(example["input_ids"]))
                out["trained"].append(sum(1 for t in example["labels"] if t != IGNORE))
        return out

    return to_examples


def _fit(examples: datasets.Dataset, data_args: DataArguments, label: str, map_args: dict) -> tuple[
        datasets.Dataset, list[str], int]:
    """Examples longer than block_size dropped or truncated (counted), and any left with nothing to train dropped."""
    block, notes, n = data_args.block_size, [], len(examples)
    long = sum(1 for length in examples["length"] if length > block)
    if long and data_args.overlong == "truncate":
        examples = examples.map(lambda b: {"input_ids": [x[:block] for x in b["input_ids"]],
                                           "labels": [x[:block] for x in b["labels"]],
                                           "length": [min(n, block) for n in b["length"]],
                                           "trained": [sum(1 for t in x[:block] if t != IGNORE) for x in b["labels"]]},
                                batched=True, desc=f"truncate {label} to {block} tokens", **map_args)
        notes.append(f"{label}: truncated {long} of {n} examples to block_size={block} tokens (overlong: truncate)")
    elif long:
        examples = examples.filter(lambda b: [length <= block for length in b["length"]], batched=True,
                                   desc=f"drop {label} examples longer than {block}", **map_args)
        notes.append(f"{label}: dropped {long} of {n} examples longer than block_size={block} tokens (overlong: "
                     f"drop; overlong: truncate keeps their first {block} tokens)")
    untrained = sum(1 for t in examples["trained"] if t == 0)
    if untrained:
        examples = examples.filter(lambda b: [t > 0 for t in b["trained"]], batched=True,
                                   desc=f"drop untrained {label} examples", **map_args)
        notes.append(f"{label}: dropped {untrained} examples with no trained token"
                     + (" left after truncation" if long and data_args.overlong == "truncate" else ""))
    return examples, notes, n - len(examples)


def _mix(parts: list[tuple[DataSource, datasets.Dataset]], seed: int) -> tuple[datasets.Dataset, list[str]]:
    """One shuffled dataset holding each source's share: `examples` as counts, `weight` as shares of the total."""
    if len(parts) == 1 and parts[0][0].examples is None:
        return parts[0][1], []
    sizes = [len(ds) for _, ds in parts]
    if any(s.examples is not None for s, _ in parts):
        targets = [s.examples for s, _ in parts]
    elif all(s.weight is None for s, _ in parts):
        targets = sizes
    else:
        weights = [s.weight or 1.0 for s, _ in parts]
        total = sum(sizes)
        targets = [max(1, round(total * w / sum(weights))) for w in weights]
    rng = random.Random(seed)
    chosen, notes = [], []
    for (source, ds), size, target in zip(parts, sizes, targets):
        order = list(range(size))
        rng.shuffle(order)
        indices = order * (target // size) + order[: target % size]
        chosen.append(ds.select(indices))
        notes.append(f"mix: {source.label}: {target} examples ({target / size:.2f} x its {size})")
    mixed = datasets.concatenate_datasets(chosen).shuffle(seed=seed)
    return mixed, notes


def _end_of_turn_note(tok: Tokenizer, sources) -> list[str]:
    """Says so when the template's generation markers leave the assistant's end-of-turn token out (it is trained
    with the turn all the same), found on the first chat row (the map may have run in other processes, or not at
    all when its result was cached)."""
    for source, fmt, rows in sources:
        if fmt == "chat" and tok.use_markers and not tok.train_on_inputs:
            column = messages_column_of(rows.column_names, source)
            tok.chat(rows[0][column], tools_of(rows[0].get("tools")))
            break
    if tok.end_of_turn_outside is None:
        return []
    return [f"the chat template's {{% generation %}} markers leave {tok.end_of_turn_outside} out of the assistant's "
            "turns; it is trained with each turn all the same, so the model learns to stop"]


def _mixed_and_held_out(parts: list[tuple[DataSource, datasets.Dataset]], pct: int, seed: int) -> tuple[
        datasets.Dataset, datasets.Dataset | None, list[str]]:
    """The training mixture and, with `validation_split_percentage`, the rows held out of it: each source split
    before it is mixed, so a row repeated by its weight or count is never in both."""
    held = []
    if pct:
        splits = [(source, *_split(ds, pct, seed)) for source, ds in parts]
        parts, held = [(source, train) for source, train, _ in splits], [test for _, _, test in splits]
    train, notes = _mix(parts, seed)
    return train, datasets.concatenate_datasets(held) if held else None, notes


def _split(train: datasets.Dataset, pct: int, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    if not 0 < pct < 100:
        raise DataError(f"validation_split_percentage={pct}; it must be between 1 and 99 (or 0 for none).")
    try:
        split = train.train_test_split(test_size=pct / 100, seed=seed)
    except ValueError as e:  # a split that leaves train empty
        raise DataError(f"validation_split_percentage={pct} cannot split {len(train)} train rows ({e}); give more "
                        "data or a validation_file.") from e
    return split["train"], split["test"]


def build_datasets(data_args: DataArguments, tokenizer, training_args, max_positions: int,
                   tokenizer_name: str = "the model") -> Prepared:
    """Train and eval datasets, built on rank 0 first (the others read its cache)."""
    with training_args.main_process_first(desc="load, tokenize and pack"):
        return build_examples(data_args, tokenizer, training_args.seed, max_positions, tokenizer_name)


def build_examples(data_args: DataArguments, tokenizer, seed: int, max_positions: int,
                   tokenizer_name: str = "the model") -> Prepared:
    """`build_datasets` in this process alone (no process group): what `hf-zero3 data` shows."""
    if problem := block_size_problem(data_args.block_size, max_positions):
        raise DataError(problem)
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; set one (documents and completions end with EOS).")
    sources = _formats_and_rows(data_args)
    validation = _validation_rows(data_args)
    formats = {fmt for _, fmt, _ in sources}
    map_args = dict(num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache)
    if problem := _validation_problem(formats, validation):
        raise DataError(problem)
    if formats == {"text"}:
        return _text_blocks(data_args, tokenizer, sources, validation, seed, map_args)
    tok = _tokenizer_for(data_args, tokenizer, tokenizer_name, formats | ({validation[1]} if validation else set()))
    notes, parts, dropped = [], [], 0
    for i, (source, fmt, rows) in enumerate(sources):
        label = source.label
        examples = rows.map(_examples_fn(tok, source, fmt, rows.column_names, data_args.block_size, label),
                            batched=True, with_indices=True, remove_columns=rows.column_names,
                            desc=f"tokenize {label} ({fmt})", **map_args)
        examples, fitted, lost = _fit(examples, data_args, label, map_args)
        notes += fitted
        dropped += lost
        if len(examples) == 0:
            raise DataError(f"{_what(data_args, i)} {label!r} has no example that fits block_size="
                            f"{data_args.block_size}; raise block_size or set overlong: truncate.")
        parts.append((source, examples))
    notes += _end_of_turn_note(tok, sources)
    train, evaluation, mixed = _mixed_and_held_out(parts, 0 if validation else data_args.validation_split_percentage,
                                                   seed)
    notes += mixed
    if validation is not None:
        source, fmt, rows = validation
        evaluation = rows.map(_examples_fn(tok, source, fmt, rows.column_names, data_args.block_size, source.label),
                              batched=True, with_indices=True, remove_columns=rows.column_names,
                              desc=f"tokenize {source.label} ({fmt})", **map_args)
        evaluation, fitted, _ = _fit(evaluation, data_args, source.label, map_args)
        notes += fitted
    lengths, trained = train["length"], sum(train["trained"])
    tokens = sum(lengths)
    attended = sum(n * n for n in lengths) / max(tokens, 1)
    train = train.remove_columns(["length", "trained"])
    evaluation = evaluation.remove_columns(["length", "trained"]) if evaluation is not None else None
    notes.append(f"{len(lengths)} train examples: {tokens} tokens, {trained} trained ({trained / max(tokens, 1):.0%})")
    return _limited(Prepared(train, evaluation, PACKED if data_args.packing else PADDED, tokens, attended, notes,
                             trained, dropped), data_args)


def _text_blocks(data_args, tokenizer, sources, validation, seed, map_args) -> Prepared:
    """Raw text only: documents tokenized, EOS-terminated, joined and cut into full blocks."""
    eos, block = tokenizer.eos_token_id, data_args.block_size

    def documents(column):
        def tokenize(batch):
            """Token ids per document, EOS-terminated; empty documents vanish. Special tokens the tokenizer adds
            itself (e.g. a Llama BOS) stay, and an EOS it already appends is not doubled."""
            texts = [t for t in batch[column] if t and not t.isspace()]
            ids = tokenizer(texts)["input_ids"] if texts else []
            return {"input_ids": [x if x and x[-1] == eos else x + [eos] for x in ids]}
        return tokenize

    def tokenized(source, rows, name):
        return rows.map(documents(source.text_column), batched=True, remove_columns=rows.column_names,
                        desc=f"tokenize {name}", **map_args)

    parts = [(source, tokenized(source, rows, source.label)) for source, _, rows in sources]
    train_docs, held_out, notes = _mixed_and_held_out(
        parts, 0 if validation else data_args.validation_split_percentage, seed)
    splits = {"train": train_docs}
    if validation is not None:
        splits["validation"] = tokenized(validation[0], validation[2], "validation")
    elif held_out is not None:
        splits["validation"] = held_out
    from trl import pack_dataset  # TRL takes seconds: only once the data is in

    def full_blocks(docs, name):
        """TRL's wrapped packing: the documents of each map batch joined and cut into blocks, each batch's remainder
        dropped. A batch holds about BLOCKS_PER_BATCH blocks of tokens (at least 1000 documents, `datasets`'
        default), in one process: a long block_size with the default batch of 1000 short documents would get no
        block at all, and a shard per process would drop a remainder each."""
        ids = docs.data.column("input_ids") if "input_ids" in docs.column_names else None  # none: all empty
        per_doc = (pc.mean(pc.list_value_length(ids)).as_py() if ids is not None else None) or 1  # arrow: no copy
        batch = max(1000, int(BLOCKS_PER_BATCH * block / per_doc))
        wrapped = pack_dataset(docs, block, "wrapped", {"desc": f"pack {name} into {block}-token blocks",
                                                        "batch_size": batch, **map_args, "num_proc": None})
        return wrapped.filter(lambda b: [len(x) == block for x in b["input_ids"]], batched=True, **map_args).map(
            lambda b: {"labels": b["input_ids"]}, batched=True, **map_args)

    blocks = {name: full_blocks(docs, name) for name, docs in splits.items()}
    for name, ds in blocks.items():
        if len(ds) == 0:
            # An all-empty map output keeps its input schema (datasets quirk), so count rows first.
            n_tokens = sum(len(x) for x in splits[name]["input_ids"]) if len(splits[name]) else 0
            if n_tokens == 0:
                raise DataError(f"the {name} data has no text in column {sources[0][0].text_column!r}; give it "
                                "non-empty text.")
            raise DataError(f"the {name} data has only {n_tokens} tokens, fewer than one block (block_size={block}); "
                            f"use a smaller block_size (<= {n_tokens}) or more data.")
    total = block * len(blocks["train"])
    return _limited(Prepared(blocks["train"], blocks.get("validation"), BLOCKS, total, block, notes, total),
                    data_args)


def _limited(prepared: Prepared, data_args: DataArguments) -> Prepared:
    if data_args.max_train_samples is not None and data_args.max_train_samples < len(prepared.train):
        prepared.train = prepared.train.select(range(data_args.max_train_samples))
        prepared.tokens = sum(map(len, prepared.train["input_ids"]))
        prepared.trained = sum(sum(t != IGNORE for t in x) for x in prepared.train["labels"])
    if prepared.eval is not None and data_args.max_eval_samples is not None:
        prepared.eval = prepared.eval.select(range(min(data_args.max_eval_samples, len(prepared.eval))))
    return prepared


# -- before anything starts ------------------------------------------------------------------------------------------

def data_problems(values: dict, load_tokenizer) -> tuple[list[str], set[str]]:
    """Everything wrong with the data that shows before the process group starts, all at once (files, formats,
    every row's structure, the chat template on a sample: the first row, and the first with each role), and the
    formats found. Local files are read here (every rank reads the same `datasets` cache); a Hub dataset is only
    looked up. `load_tokenizer()` gives (the run's tokenizer, its name), called only when chat data needs it; None skips the
    sample render (the model's own inputs are wrong)."""
    known = {k: v for k, v in values.items() if k in DataArguments.__dataclass_fields__}
    try:
        data_args = DataArguments(**known)
        sources = sources_of(data_args)
    except DataError as e:
        return [str(e)], set()
    problems = []
    for i, source in enumerate(sources):
        what = _what(data_args, i)
        if source.path and (problem := file_problem(source.path, what)):
            problems.append(problem)
        elif source.name and (problem := dataset_problem(source.name, source.config, what)):
            problems.append(problem)
    if data_args.validation_file and (problem := file_problem(data_args.validation_file, "validation_file")):
        problems.append(problem)
    if problems or any(s.name for s in sources):
        return problems, set()
    try:
        loaded = _formats_and_rows(data_args)
        validation = _validation_rows(data_args)
    except DataError as e:
        return [str(e)], set()
    if problem := _validation_problem({fmt for _, fmt, _ in loaded}, validation):
        return [problem], set()
    checked = loaded + ([validation] if validation else [])
    formats = {fmt for _, fmt, _ in checked}
    if formats <= {"text"} or load_tokenizer is None:
        return [], formats
    try:
        tokenizer, name = load_tokenizer()
        tok = _tokenizer_for(data_args, tokenizer, name, formats)
        for source, fmt, rows in checked:
            _render_sample(tok, source, fmt, rows, data_args)
    except DataError as e:
        return [str(e)], formats
    return [], formats


def _render_sample(tok: Tokenizer, source: DataSource, fmt: str, rows: datasets.Dataset, data_args) -> None:
    """Render and mask a few rows: the template's failures (no template, a role it refuses, no assistant tokens
    marked) show before the run starts."""
    if fmt in ("text", "alpaca"):
        return
    column = messages_column_of(rows.column_names, source) if fmt == "chat" else source.prompt_column
    picked, roles = [0], set()
    for i, turns in enumerate(rows[column][:10_000]):
        new = {t.get("role") for t in as_messages(turns) if isinstance(t, dict)} - roles if isinstance(turns, list) \
            else set()
        if new & set(ROLES):
            picked.append(i)
            roles |= new
    fn = _examples_fn(tok, source, fmt, rows.column_names, data_args.block_size, source.label)
    for i in sorted(set(picked)):
        out = fn(rows[i:i + 1], [i])
        if not data_args.train_on_inputs and out["labels"] and all(t == IGNORE for t in out["labels"][0]):
            raise DataError(f"{source.label}, row {i + 1}: the chat template marks no token of it as trained (its "
                            "{% generation %} markers cover no assistant text?): fix the template (chat_template) "
                            "or set train_on_inputs true.")
