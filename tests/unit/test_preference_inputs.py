"""Bad inputs of the preference stages, each one line naming the field and the fix before anything starts
(`run.checks.check_inputs` -> `run.stages.stage_problems`), and over-long pairs dropped whole and counted."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_zero3.data.arguments import DataArguments
from hf_zero3.data.preference import PAIRS, build_preference
from hf_zero3.job.arguments import UsageError, load_arguments
from hf_zero3.run.checks import check_inputs
from tests.conftest import ROOT, TINY_YAML, error_naming

PAIRS_FILE = ROOT / "assets/tiny/preference/pairs.jsonl"
UNPAIRED_FILE = ROOT / "assets/tiny/preference/unpaired.jsonl"
ROW = {"prompt": "question: what does the duck say?\nanswer:", "chosen": " the duck says quack.",
       "rejected": " the duck lives in the pond."}


def rows_file(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def other_vocabulary(tmp_path) -> str:
    config = AutoConfig.from_pretrained(ROOT / "assets/tiny/model")
    config.vocab_size = 2048
    config.save_pretrained(tmp_path / "other")
    return str(tmp_path / "other")


def tmp_weights(tmp_path):
    """The tiny model with random weights saved as a LoRA run's base."""
    folder = tmp_path / "base"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model")).save_pretrained(folder)
    AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model").save_pretrained(folder)
    return folder


CASES = {  # name: (overrides (a callable of tmp_path for files), field named, phrases of the fix)
    "chosen missing": (lambda t: {"train_file": rows_file(t, [{"prompt": "a", "rejected": "b"}])},
                       "no chosen column", ("rename",)),
    "chosen equals rejected": (lambda t: {"train_file": rows_file(t, [{**ROW, "rejected": ROW["chosen"]}] * 3)},
                               "chosen equals rejected on every row", ("preferred answer in chosen",)),
    "kto label not boolean": (lambda t: {"stage": "kto", "train_file": rows_file(
        t, [{"prompt": "a", "completion": " b", "label": "yes"}])}, "label is 'yes'", ("true", "false")),
    "reference of another vocabulary": (lambda t: {"ref_model_name_or_path": other_vocabulary(t)},
                                        "ref_model_name_or_path", ("vocab_size 2048 vs 1024", "leave")),
    "beta not positive": (lambda t: {"stage_args": {"beta": 0}}, "stage_args.beta", ("> 0",)),
    "unknown loss type": (lambda t: {"stage_args": {"loss_type": "sigmod"}}, "stage_args.loss_type",
                          ("did you mean sigmoid",)),
    "unknown stage argument": (lambda t: {"stage_args": {"betta": 0.2}}, "stage_args.betta",
                               ("did you mean beta",)),
    "precompute with a synced reference": (lambda t: {"stage_args": {"precompute_ref_log_probs": True,
                                                                     "sync_ref_model": True}},
                                           "precompute_ref_log_probs", ("set one of them false",)),
    "a reference model with LoRA": (lambda t: {"ref_model_name_or_path": str(ROOT / "assets/tiny/model"),
                                              "peft": {"r": 8}, "model_name_or_path": str(tmp_weights(t))},
                                    "ref_model_name_or_path with peft",
                                    ("remove ref_model_name_or_path",)),
    "unknown stage": (lambda t: {"stage": "dpoo"}, "stage 'dpoo'", ("did you mean dpo",)),
    "a training argument in stage_args": (lambda t: {"stage_args": {"learning_rate": 1e-6}},
                                          "stage_args.learning_rate", ("top level",)),
}


@pytest.mark.parametrize("case", CASES)
def test_a_bad_preference_input_is_one_line_naming_the_fix(tmp_path, case):
    overrides, field, fix = CASES[case]
    values = {**load_arguments([str(TINY_YAML)]), "stage": "dpo", "train_file": str(PAIRS_FILE),
              "validation_file": None, **overrides(tmp_path)}
    with pytest.raises(UsageError) as raised:
        check_inputs(values, device="cpu")
    error_naming(str(raised.value), field, *fix)
    assert len(str(raised.value).splitlines()) == 1


def test_the_shipped_preference_files_pass_the_checks():
    values = {**load_arguments([str(TINY_YAML)]), "validation_file": None}
    check_inputs({**values, "stage": "dpo", "train_file": str(PAIRS_FILE), "stage_args": {"beta": 0.2}}, "cpu")
    check_inputs({**values, "stage": "kto", "train_file": str(UNPAIRED_FILE)}, "cpu")


def test_over_long_pairs_are_dropped_whole_and_counted(tmp_path):
    """A pair whose rejected answer alone is too long goes, chosen and all; the others stay untouched."""
    long = {**ROW, "rejected": " the duck says quack." * 20}
    args = DataArguments(train_file=rows_file(tmp_path, [ROW, long, ROW]), block_size=32)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model")
    prepared = build_preference(args, tokenizer, PAIRS, seed=0)
    assert prepared.dropped == 1 and len(prepared.train) == 2
    assert prepared.train[0] == ROW and prepared.train[1] == ROW
    assert any("1 pairs longer than block_size=32 dropped whole" in n for n in prepared.notes)


def test_hf_zero3_data_shows_each_pairs_chosen_and_rejected_with_the_answer_trained(capsys):
    from hf_zero3.cli import main

    assert main(["data", str(TINY_YAML), "--stage", "dpo", "--train_file", str(PAIRS_FILE), "--validation_file",
                 "null", "--block_size", "32", "--show", "1"]) == 0
    out = capsys.readouterr().out
    assert "44 pairs longer than block_size=32 dropped whole" in out and "examples 356" in out
    assert "chosen, trained between" in out and "rejected, trained between" in out
    assert "answer:« four minus one is three.</s>»" in out  # the prompt untrained, the answer and its EOS trained


def test_a_stored_precompute_of_another_hash_is_refused_naming_what_differs_and_the_same_hash_is_reused(tmp_path):
    """output_dir/reference_logps/<split>/<hash>: the run that stored it (or its resume) gets it back; a run whose
    train data, chat template or reference weights differ is refused before the pass, the parts that differ named,
    with the fix; a new validation file on a resume reuses the train log-probs and keys only its eval ones anew."""
    import datasets
    import torch
    from transformers import TrainingArguments

    from hf_zero3.run.preference import KEY_FILE, REFERENCE_FOLDER, precomputed_reference_folders

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model"))
    rows = datasets.Dataset.from_json(str(PAIRS_FILE))
    train, validation = rows.select(range(16)), rows.select(range(16, 20))
    args = TrainingArguments(output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none")
    folders, stored, evaluation = precomputed_reference_folders(args, train, None, tokenizer, model)
    where = folders["train"]
    assert set(folders) == {"train"} and where.parent == tmp_path / "run" / REFERENCE_FOLDER / "train"
    assert (where / KEY_FILE).is_file() and stored.to_list() == train.to_list() and evaluation is None
    again, *_ = precomputed_reference_folders(args, train.select(range(16)), None, tokenizer, model)  # a resume
    assert again == folders and [p.name for p in where.parent.iterdir()] == [where.name]

    (where / "logps").mkdir()  # the train log-probs, as the trainer stores them
    for evaluated in (validation, validation.select(range(3))):  # a validation file added, then changed, on resume
        resumed, stored, evaluation = precomputed_reference_folders(args, train, evaluated, tokenizer, model)
        assert resumed["train"] == where and (where / "logps").is_dir()  # the train log-probs reused
        assert resumed["eval"].parent == tmp_path / "run" / REFERENCE_FOLDER / "eval"
        assert evaluation.to_list() == evaluated.to_list() and (resumed["eval"] / KEY_FILE).is_file()
    assert len(list(resumed["eval"].parent.iterdir())) == 2  # each validation set keyed by its own rows

    def refusal(*changed) -> str:
        with pytest.raises(ValueError) as info:
            precomputed_reference_folders(args, *changed)
        return error_naming(str(info.value), "precompute_ref_log_probs", "train rows", str(where), "--output_dir",
                            "delete")

    assert "differ in: data)" in refusal(train.select(range(15)), validation, tokenizer, model)
    templated = AutoTokenizer.from_pretrained(ROOT / "assets/tiny/model")
    templated.chat_template = "{{ messages }}"
    assert "differ in: chat template)" in refusal(train, None, templated, model)
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert "differ in: reference weights)" in refusal(train, None, tokenizer, model)
    (where / KEY_FILE).unlink()  # stored without its parts: the refusal says what the hash covers
    assert "differ in: data, tokenizer, chat template or reference weights (not recorded)" in refusal(
        train, None, tokenizer, model)


def test_the_reference_hash_of_a_lora_run_is_its_base_whatever_the_adapter():
    """With LoRA the reference is the base with the adapter disabled: its precomputed log-probs stay reusable under
    another seed or rank of the new adapter, and not under other base weights."""
    import peft
    import torch

    from hf_zero3.run.preference import weights_hash

    def with_adapter(base_seed: int, adapter_seed: int, r: int):
        torch.manual_seed(base_seed)
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "assets/tiny/model"))
        torch.manual_seed(adapter_seed)
        return peft.get_peft_model(base, peft.LoraConfig(r=r, target_modules="all-linear"))

    first = weights_hash(with_adapter(0, 1, 8))
    assert weights_hash(with_adapter(0, 2, 8)) == first and weights_hash(with_adapter(0, 1, 4)) == first
    assert weights_hash(with_adapter(3, 1, 8)) != first
