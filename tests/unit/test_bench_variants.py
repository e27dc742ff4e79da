"""`hf-zero3 bench` baselines and report, without running anything: the tuned baselines are every switch a competent
user flips without code, each setting searches its micro batch down on out-of-memory, every variant trains the
recipe's global batch, and the report names the best baseline that ran and every baseline run that failed."""

from __future__ import annotations

import json
import signal

import pytest

from hf_zero3.ops.baselines import (
    STOCK_ZERO2,
    STOCK_ZERO3,
    Search,
    Tuned,
    build_slots,
    expand_against,
    micro_candidates,
    search_state,
    selected,
    variants_of,
)
from hf_zero3.ops.bench import aggregate, render_report
from tests.conftest import ROOT, error_naming

RECIPE = ROOT / "recipes" / "8b"


def _value(overrides: list[str], key: str) -> str:
    return overrides[len(overrides) - 1 - overrides[::-1].index(key) + 1]  # the last one given wins


def _searches(slots) -> dict[str, Search]:
    return {s.setting: s for s in slots if isinstance(s, Search)}


def test_tuned_is_every_engine_with_liger_fused_adamw_and_checkpointing_on_and_off():
    slots = build_slots(RECIPE, ["tuned"], False, True, global_batch=16, gpus=1)
    searches = _searches(slots)
    assert list(searches) == [f"{engine}_{ckpt}" for engine in ("stock_tuned", "zero2_tuned", "fsdp2_tuned",
                                                                "plain_tuned") for ckpt in ("nockpt", "ckpt")]
    for search in searches.values():
        # from the per-rank batch down, through its divisors; each keeps the global batch
        assert [v.micro for v in search.candidates] == [16, 8, 4, 2, 1]
        for variant in search.candidates:
            assert variant.micro * int(_value(variant.overrides, "--gradient_accumulation_steps")) == 16
            assert int(_value(variant.overrides, "--per_device_train_batch_size")) == variant.micro
            assert _value(variant.overrides, "--use_liger_kernel") == "true"
            assert _value(variant.overrides, "--optim") == "adamw_torch_fused"
            assert variant.baseline == search.baseline and variant.setting == search.setting
    zero3, zero2 = searches["stock_tuned_ckpt"].candidates[1], searches["zero2_tuned_nockpt"].candidates[0]
    assert zero3.name == "stock_tuned_8_ckpt" and zero3.launcher == "deepspeed"
    assert zero3.ds_config == {k: v for k, v in STOCK_ZERO3.items() if k not in ("optimizer", "scheduler")}
    assert _value(zero3.overrides, "--gradient_checkpointing") == "true"
    assert json.loads(_value(zero3.overrides, "--gradient_checkpointing_kwargs")) == {"use_reentrant": False}
    assert zero2.name == "zero2_tuned_16" and zero2.ds_config["zero_optimization"] == STOCK_ZERO2["zero_optimization"]
    assert _value(zero2.overrides, "--gradient_checkpointing") == "false"
    fsdp2 = searches["fsdp2_tuned_ckpt"].candidates[0]
    assert fsdp2.launcher == "torchrun" and fsdp2.ds_config is None and _value(fsdp2.overrides, "--deepspeed") == "null"
    fsdp = json.loads(_value(fsdp2.overrides, "--fsdp_config"))
    assert fsdp["fsdp_version"] == 2 and fsdp["activation_checkpointing"] is True
    assert _value(fsdp2.overrides, "--gradient_checkpointing") == "false"  # FSDP's own, never recomputed twice
    plain = searches["plain_tuned_ckpt"].candidates[0]
    assert plain.launcher == "torchrun" and plain.ds_config is None and _value(plain.overrides, "--deepspeed") == "null"
    assert "--fsdp" not in plain.overrides and _value(plain.overrides, "--gradient_checkpointing") == "true"


def test_the_plain_trainer_joins_tuned_on_one_gpu_only_and_runs_as_ddp_when_named():
    assert expand_against(["tuned"], 1) == ["stock_tuned", "zero2_tuned", "fsdp2_tuned", "plain_tuned"]
    assert expand_against(["tuned"], 2) == ["stock_tuned", "zero2_tuned", "fsdp2_tuned"]
    assert expand_against(["stock", "tuned", "stock_tuned", "plain_tuned"], 8) == [
        "stock", "stock_tuned", "zero2_tuned", "fsdp2_tuned", "plain_tuned"]


def test_a_search_starts_at_the_given_micro_batch_and_tries_the_divisors_below():
    assert micro_candidates(None, 12) == [12, 6, 4, 3, 2, 1]
    assert micro_candidates(5, 12) == [4, 3, 2, 1]  # a start that does not divide: the next divisor below
    assert micro_candidates(64, 6) == [6, 3, 2, 1]
    tuned = Tuned.collect(["stock_tuned=8+ckpt", "stock_tuned=2", "stock_tuned=8+ckpt"])  # a repeat runs once
    searches = _searches(build_slots(RECIPE, ["stock_tuned"], False, True, global_batch=16, gpus=2, tuned=tuned))
    assert {k: [v.name for v in s.candidates] for k, s in searches.items()} == {
        "stock_tuned_ckpt": ["stock_tuned_8_ckpt", "stock_tuned_4_ckpt", "stock_tuned_2_ckpt", "stock_tuned_1_ckpt"],
        "stock_tuned_nockpt": ["stock_tuned_2", "stock_tuned_1"]}
    assert _value(searches["stock_tuned_nockpt"].candidates[0].overrides, "--gradient_accumulation_steps") == "4"


def test_a_global_batch_the_ranks_do_not_divide_is_refused_with_the_fix():
    with pytest.raises(ValueError) as err:
        build_slots(RECIPE, ["tuned"], False, True, global_batch=9, gpus=2)
    error_naming(str(err.value), "global batch 9", "2 ranks", "gradient_accumulation")
    build_slots(RECIPE, ["stock"], False, True, global_batch=9, gpus=2)  # the documented ones run the recipe's batch


def _run(tokens: float, peak: float) -> dict:
    return {"tokens_per_s_per_gpu": tokens, "tflops_per_gpu": tokens / 20, "mfu": tokens / 20000, "step_time_s": 1.0,
            "ds_fwd_ms": None, "ds_bwd_ms": None, "ds_step_ms": None, "gpu_peak_allocated_gib": peak,
            "gpu_peak_reserved_gib": peak + 1, "host_rss_gib": 2.0, "final_loss": 11.0, "steps_measured": 4}


OOM = {"error": "out of memory at micro batch 16: exit 1: torch.OutOfMemoryError: CUDA out of memory (log: x.log)",
       "out_of_memory": True}


def test_a_search_goes_down_on_out_of_memory_only():
    [search] = [s for s in build_slots(RECIPE, ["stock_tuned"], False, True, global_batch=16, gpus=1,
                                       tuned=Tuned.collect(["stock_tuned=16+ckpt"])) if isinstance(s, Search)]
    names = [v.name for v in search.candidates]
    assert search_state(search, {}) == ("next", search.candidates[0])
    assert search_state(search, {names[0]: OOM}) == ("next", search.candidates[1])
    assert search_state(search, {names[0]: OOM, names[1]: _run(9000, 120)}) == ("found", search.candidates[1])
    other = {"error": "exit 2: error: block_size=100000 exceeds the model's max positions (512)"}
    assert search_state(search, {names[0]: OOM, names[1]: other}) == ("failed", None)  # not a matter of micro batch
    assert search_state(search, dict.fromkeys(names, OOM)) == ("failed", None)  # fits at no micro batch


def test_only_selects_a_baseline_a_setting_or_one_run():
    slots = build_slots(RECIPE, ["stock_tuned", "stock"], False, True, global_batch=4, gpus=1)
    ckpt = _searches(slots)["stock_tuned_ckpt"]
    assert selected(ckpt, frozenset({"stock_tuned"})) and selected(ckpt, frozenset({"stock_tuned_ckpt"}))
    assert not selected(ckpt, frozenset({"stock_tuned_nockpt"})) and selected(ckpt, frozenset({"stock_tuned_2_ckpt"}))
    assert selected(slots[0], frozenset({"ours"})) and not selected(slots[0], frozenset({"stock"}))
    assert [v.name for v in variants_of(slots)][:2] == ["ours", "stock_tuned_4"]


def test_other_recipe_folders_run_with_their_own_yaml_and_config(tmp_path):
    (tmp_path / "train_args.yaml").write_text("block_size: 64\n")
    (tmp_path / "ds_config.json").write_text('{"zero_optimization": {"stage": 2}}')
    slots = build_slots(RECIPE, [], False, True, others={"z2": tmp_path})
    assert [v.name for v in slots] == ["ours", "z2"]
    assert slots[1].recipe_dir == tmp_path and slots[1].ds_config == {"zero_optimization": {"stage": 2}}


META = {"title": "t", "date": "d", "hardware": "h", "versions": {}, "model": "m", "seq_len": 4096, "global_batch": 16,
        "steps": 4, "warmup": 2, "repeats": 3, "commands": ["hf-zero3 bench 7b"], "configs": {}}


def test_repeats_report_medians_spread_and_each_run():
    ours = aggregate([_run(10000, 110), _run(9000, 112), _run(10400, 111)])
    stock = aggregate([_run(8000, 120), {"error": "exit 1: NCCL timeout"}, _run(7000, 121)])
    assert ours["tokens_per_s_per_gpu"] == 10000 and ours["gpu_peak_allocated_gib"] == 112
    assert stock["tokens_per_s_per_gpu"] == 7500  # median of the two that ran
    text = render_report(META, {"ours": ours, "stock": stock})
    assert "| ours | 10000 | 500.0 | 50.0% | 112.00 |" in text and text.count("| 3: 9000-10400 |") == 1
    assert "| 2: 7000-8000 (1 failed) |" in text
    assert "ours / stock: 1.33x tokens/s" in text
    assert "| ours | 2 | 9000 |" in text and "| stock | 2 | failed: exit 1: NCCL timeout |" in text
    assert "3 run(s) per config" in text
    assert aggregate([{"error": "exit 1: x"}])["error"] == "exit 1: x"
    without_ours = render_report(META, {"stock": stock})  # `--only stock`: a table, no ratio
    assert "| stock | 7500 |" in without_ours and "ours /" not in without_ours


def test_the_report_names_the_best_baseline_and_keeps_every_failed_one():
    """On one H200 a 7B's stock ZeRO-3 with Liger and checkpointing at micro 8 beat the plain Trainer at micro 4: the
    best baseline is the fastest of every engine and setting that ran; the ones that ran out of memory are listed."""
    baselines = {"stock_tuned_16_ckpt": "stock_tuned", "stock_tuned_8_ckpt": "stock_tuned", "stock_tuned_1": "stock_tuned",
                 "plain_tuned_4_ckpt": "plain_tuned", "fsdp2_tuned_8_ckpt": "fsdp2_tuned"}
    results = {"ours": aggregate([_run(11_615, 120)]), "stock_tuned_16_ckpt": aggregate([OOM]),
               "stock_tuned_8_ckpt": aggregate([_run(10_207, 121)]), "stock_tuned_1": aggregate([_run(7_500, 125)]),
               "plain_tuned_4_ckpt": aggregate([_run(9_848, 130)]),
               "fsdp2_tuned_8_ckpt": aggregate([{"error": "exit 1: accelerate has no fsdp_version 2"}])}
    text = render_report({**META, "baselines": baselines}, results)
    error_naming(text, "**The best baseline: stock_tuned_8_ckpt**", "10,207", "3 baseline configs", "**1.14x**")
    error_naming(text, "ours / the best stock_tuned", "stock_tuned_8_ckpt, 10,207",
                 "stock_tuned_16_ckpt, stock_tuned_8_ckpt, stock_tuned_1", "1.14x")
    failed = error_naming(text, "Baseline runs that failed")
    assert "stock_tuned_16_ckpt (out of memory at micro batch 16" in failed
    assert "fsdp2_tuned_8_ckpt (exit 1: accelerate has no fsdp_version 2)" in failed and "(log:" not in failed
    row = error_naming(text, "| stock_tuned_16_ckpt |")
    assert [c.strip() for c in row.split("|")][2].startswith("failed: out of memory at micro batch 16"), row
    results["stock_tuned_8_ckpt"] = aggregate([OOM])
    assert "**The best baseline: plain_tuned_4_ckpt** (9,848" in render_report({**META, "baselines": baselines},
                                                                               results)
    nothing = {"ours": results["ours"], "plain_tuned_4_ckpt": aggregate([OOM])}
    assert "No baseline ran" in render_report({**META, "baselines": baselines}, nothing)


def test_a_scratch_run_folder_is_emptied_only_when_the_bench_made_it(tmp_path):
    from hf_zero3.ops.bench import scratch_run_dir

    run_dir = tmp_path / "ours"
    scratch_run_dir(run_dir)  # new: nothing to clear, the owner file is written beside it
    run_dir.mkdir()
    (run_dir / "train_log.jsonl").write_text("{}\n")
    scratch_run_dir(run_dir)  # ours: the old records go
    assert not run_dir.exists() and (tmp_path / "ours.owner").is_file()

    theirs = tmp_path / "stock"
    theirs.mkdir()
    (theirs / "checkpoint-100").mkdir()
    with pytest.raises(ValueError, match="was not left by hf-zero3.*pass another --work-dir"):
        scratch_run_dir(theirs)
    assert (theirs / "checkpoint-100").is_dir()


def test_bench_only_accepts_the_names_of_its_settings_and_runs(capsys):
    from hf_zero3.cli import main

    argv = ["bench", "tiny", "--gpus", "2", "--against", "stock_tuned", "--tuned", "stock_tuned=1",
            "--tuned", "stock_tuned=2+ckpt"]
    assert main([*argv, "--only", "stock_tuned_3"]) == 2
    err = capsys.readouterr().err
    assert "['stock_tuned_3'] not in this bench" in err and "stock_tuned_2_ckpt" in err and "stock_tuned_ckpt" in err


@pytest.mark.parametrize("bad", ["stock=4", "stock_tuned=0", "stock_tuned=four", "stock_tuned=4+offload",
                                 "tuned=4"])
def test_a_bad_tuned_setting_names_the_form(bad):
    with pytest.raises(ValueError, match=r"NAME=MICRO or NAME=MICRO\+ckpt"):
        Tuned.parse(bad)


def test_bench_refuses_tuned_settings_for_a_baseline_it_does_not_run(capsys):
    from hf_zero3.cli import main

    assert main(["bench", "tiny", "--against", "stock", "--tuned", "stock_tuned=2"]) == 2
    assert "--tuned sets ['stock_tuned'], which --against does not run" in capsys.readouterr().err
    assert main(["bench", "tiny", "--against", "stock_tuned", "--tuned", "stock_tuned=x"]) == 2
    assert "give NAME=MICRO" in capsys.readouterr().err
    assert main(["bench", "tiny", "--gpus", "2", "--against", "tuned", "--tuned", "plain_tuned=2"]) == 2
    assert "--tuned sets ['plain_tuned']" in capsys.readouterr().err  # `tuned` on 2 ranks leaves it out


def test_bench_refuses_an_unknown_recipe_or_baseline_naming_the_choices(capsys):
    from hf_zero3.cli import main

    assert main(["bench", "no-such-recipe"]) == 2
    error_naming(capsys.readouterr().err, "no-such-recipe", "recipe", "tiny")
    assert main(["bench", "tiny", "--against", "stock,megatron"]) == 2
    error_naming(capsys.readouterr().err, "megatron", "stock_tuned", "fsdp2")


@pytest.fixture
def replayed_runs(monkeypatch):
    """Each bench run replayed from a recorded CPU run's figures instead of launched: the (variant, repeat) pairs
    asked, in order. The handler the bench sets for SIGTERM is put back afterwards."""
    from hf_zero3.ops import bench

    asked: list[tuple[str, int]] = []

    def replay(variant, repeat, repeats, gpus, recipe_dir, work_dir, steps, warmup, extra, run_timeout, label):
        asked.append((variant.name, repeat))
        records = [{"repeat": repeat, "step": step, "loss": 10.4 - 0.1 * step, "tokens_per_s_per_gpu": 2_150.0,
                    "step_time_s": 0.24, "host_rss_gib": 1.1} for step in range(1, warmup + steps + 1)]
        return {"summary": bench.summarize(records, warmup), "records": records,
                "config": {"command": f"deepspeed ... {variant.name}"}}

    monkeypatch.setattr(bench, "_run_variant", replay)
    handler = signal.getsignal(signal.SIGTERM)
    yield asked
    signal.signal(signal.SIGTERM, handler)


def test_resumed_calls_run_what_the_time_budget_allows_and_say_what_is_left(replayed_runs, tmp_path, capsys):
    """A second call with --resume, --only and a time budget runs only what fits and says how many runs are left; a
    third, without a budget, runs them and keeps the first calls' runs in the report."""
    from hf_zero3.cli import main

    out, work = tmp_path / "benchmarks", tmp_path / "work"
    common = ["--gpus", "1", "--steps", "2", "--warmup", "1", "--suffix", "tuned", "--out", str(out), "--work-dir",
              str(work), "--", "--per_device_train_batch_size", "4"]
    tuned = ["--against", "tuned", "--tuned", "stock_tuned=2", "--tuned", "zero2_tuned=3+ckpt",
             "--tuned", "fsdp2_tuned=2", "--tuned", "plain_tuned=4+ckpt"]
    assert main(["bench", "tiny", *tuned, *common]) == 0
    assert sorted(replayed_runs) == [("fsdp2_tuned_2", 1), ("ours", 1), ("plain_tuned_4_ckpt", 1),
                                     ("stock_tuned_2", 1), ("zero2_tuned_2_ckpt", 1)]
    state_path = work / "bench_state.json"
    state = json.loads(state_path.read_text())
    for runs in state["runs"].values():  # as long as each took on a CPU
        for run in runs.values():
            run["seconds"] = 30.0
    state_path.write_text(json.dumps(state))
    capsys.readouterr()

    replayed_runs.clear()
    again = ["bench", "tiny", *tuned, "--repeats", "2", "--resume", "--only", "ours,plain_tuned"]
    assert main([*again, "--time-budget", "1", *common]) == 0
    assert replayed_runs == [("ours", 2)]  # the first run of a call always runs; the next would pass the budget
    assert "bench: 1 run(s) left for the time budget (1 s)" in capsys.readouterr().out

    replayed_runs.clear()
    assert main([*again, *common]) == 0
    assert replayed_runs == [("plain_tuned_4_ckpt", 2)]
    assert "bench: all runs done" in capsys.readouterr().out
    [report] = out.glob("tiny_cpu*_*_tuned.md")
    text = report.read_text()
    assert "| ours | 1 | " in text and "| ours | 2 | " in text and "| plain_tuned_4_ckpt | 2 | " in text
    assert "| stock_tuned_2 | 1 | " in text and "| stock_tuned_2 | 2 | " not in text
    assert "--time-budget 1" in text and "--against tuned" in text
