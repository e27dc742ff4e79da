"""Figures in the benchmark reports come from the committed raw records, not from hand-typing."""

from __future__ import annotations

import importlib.util
import subprocess

from tests.conftest import ROOT

RESULTS = ROOT / "benchmarks" / "results"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_planner_vs_measured_tables_are_regenerated_from_the_records():
    """results/planner_vs_measured.md is what the planner and the committed raw records give today: a planner change
    that moves a prediction fails here until the file is rewritten."""
    assert _load("planner_vs_measured").render() == (RESULTS / "planner_vs_measured.md").read_text(), \
        "stale: run `python benchmarks/planner_vs_measured.py` and commit benchmarks/results/planner_vs_measured.md"


def test_no_committed_gpu_run_peaked_above_its_plan():
    """The planner errs high or nowhere: every committed GPU run's peak allocation is within its plan (0.5% for
    rounding). A change that plans less than a run measured fails here with that run's row."""
    table = _load("planner_vs_measured").gpu_table()
    errors = {line.split(" | ")[0]: float(line.rsplit("|", 2)[1].strip().rstrip("%")) for line in
              table.splitlines()[2:]}
    assert len(errors) > 40 and all(error >= -0.5 for error in errors.values()), errors


def test_the_8b_comparison_rows_are_those_of_its_bench_reports():
    """The 8b-vs-stock study's table quotes its bench runs: each row's tokens/s, MFU and peak memory are a row of one of
    the bench reports in the same folder."""
    import re

    study = RESULTS / "2026-11-30_8b-vs-stock"
    reports = "".join(p.read_text() for p in study.glob("llama3-8b*.md"))
    rows = re.findall(r"\| (\d{4}) \| (\d+\.\d)% \| (\d+\.\d) \|", (study / "report.md").read_text())
    assert len(rows) == 8
    measured = re.findall(r"\| (\d+) \| [\d.]+ \| ([\d.]+)% \| ([\d.]+) \|", reports)
    for tokens, mfu, peak in rows:
        assert any(t == tokens and m == mfu and abs(float(p) - float(peak)) <= 0.05 for t, m, p in measured), \
            (tokens, mfu, peak)


def test_memory_probe_replays_the_allocator_trace_to_its_peak():
    """The probe's replay: baseline + allocations - completed frees, and what was live at the maximum."""
    probe = _load("memory_probe")
    ds = [{"filename": "/v/lib/python3.12/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
          {"filename": "/v/lib/python3.12/site-packages/deepspeed/runtime/zero/stage3.py", "line": 9, "name": "step"}]
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": ds},
        {"action": "alloc", "addr": 2, "size": 50, "frames": []},  # autograd's C++ thread: no python frame
        {"action": "free_requested", "addr": 1, "size": 100},  # not yet reusable: still counted
        {"action": "alloc", "addr": 3, "size": 30, "frames": ds},
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 60, "frames": []},
    ]
    peak, index, live = probe.replay(trace, baseline=1000)
    assert (peak, index) == (1180, 3)
    assert sorted(e["addr"] for e in live) == [1, 2, 3]
    report = probe.breakdown({"device_traces": [trace]}, 0, 1000)
    assert {x["site"]: x["tensors"] for x in report["live_at_peak"]} == {
        "deepspeed/runtime/zero/stage3.py:9 step": 2, "backward (autograd engine)": 1}


def test_activation_offload_report_puts_the_planner_beside_the_2xh200_records():
    """The committed activation-offload study: bytes moved and pinned host as planned, peak allocated within +10%
    (over)."""
    report = _load("activation_offload_report")
    folder = ROOT / "benchmarks/results/2026-11-30_activation-offload/8b"
    assert "| 4096 | offload | 3,668 | 1.117 | 2.67 |" in report.render(folder)
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:7]]
            for line in report.planner_table(folder, "8b").splitlines()[2:]}
    assert rows[("24576", "offload (search, 1 step)")][2:] == ["6.188 / 6.188", "8.25 / 8.25"]
    assert rows[("16384", "offload")][2] == "4.125 / 4.125"
    assert all(0 <= float(error.rstrip("%")) <= 10 for _, error, *_ in rows.values())


def test_the_partial_checkpointing_table_is_regenerated_from_its_raw_records():
    """The table the planner's speed rows cite (one machine, four calls) is what run_medians.py makes of the JSONL."""
    medians = _load("run_medians")
    folder = ROOT / "benchmarks/results/2026-12-01_partial-ckpt-7b-1gpu"
    paths = sorted(folder.glob("call*/p7/*.jsonl"))
    assert len(paths) == 4
    rename = {("ours", "7b-partial-c1_1xH200_2026-12-01_proof.jsonl"): "ck8"}
    table = medians.table(medians.runs_by_config(paths, 2, rename))
    assert table in (ROOT / "benchmarks/results/2026-12-01_partial-ckpt-7b-1gpu/report.md").read_text()


def test_the_seed_claims_gpu_report_is_rendered_from_its_rungs():
    """The 1 x H200 ladder: the report's generated part is render_report of the committed rungs."""
    from hf_zero3.ops.compare import load_results, render_report

    summaries, records = load_results(RESULTS / "2026-12-01_seed-claims-1gpu/rungs")
    generated = render_report(summaries, records).split("\n", 2)[2]  # without the title
    assert generated in (RESULTS / "2026-12-01_seed-claims-1gpu/report.md").read_text(), \
        "rebuild it: python -m hf_zero3 compare tiny --report-only --out <copy of the folder> --label ..."


def test_the_readme_results_table_quotes_the_reports_it_links():
    """README.md's results table quotes the report each row links: its tokens/s, MFU and peak memory are in that
    report, and no row publishes a ratio (none is measured against the competent user's best baseline yet)."""
    import re

    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Results"):readme.index("## More")]
    links = dict(re.findall(r"^\[([\w-]+)\]: (\S+)$", readme, re.M))
    rows = re.findall(r"^\| [^|]+ \| [^|]+ \| [^|]+ \| \d+ \| ([\d,]+) \| ([\d.]+%) \| ([\d.]+) \| \[[^]]+\]\[([\w-]+)\] \|$",
                      section, re.M)
    assert len(rows) >= 2, section
    for tps, mfu, peak, ref in rows:
        report = (ROOT / links[ref]).read_text()
        assert tps in report or tps.replace(",", "") in report, (tps, links[ref])
        assert mfu in report and peak in report, (mfu, peak, links[ref])
    assert not re.search(r"\| [\d.]+x \|", section), "a ratio in the README's results table"


def test_the_index_names_only_scripts_and_reports_that_exist():
    """benchmarks/README.md: every harness script and report it points to is there, and every study is indexed."""
    import re

    index = (ROOT / "benchmarks/README.md").read_text()
    scripts = set(re.findall(r"benchmarks/([\w.]+\.(?:sh|py))", index))
    assert scripts and not [s for s in scripts if not (ROOT / "benchmarks" / s).is_file()]
    reports = set(re.findall(r"\]\((results/[^)]+)\)", index))
    assert not [r for r in reports if not (ROOT / "benchmarks" / r).exists()]
    studies = {p.name for p in RESULTS.iterdir() if p.is_dir()}
    indexed = {r.split("/")[1] for r in reports if r.count("/") > 1}
    assert studies == indexed, studies ^ indexed


def test_every_harness_script_parses_and_bench_names_the_recipes_it_runs():
    import subprocess

    for script in sorted((ROOT / "benchmarks").glob("*.sh")):
        assert subprocess.run(["bash", "-n", script], capture_output=True).returncode == 0, script
    proc = subprocess.run(["bash", "benchmarks/bench.sh", "/nonexistent/out"], cwd=ROOT, capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "RECIPE": "13b", "CHECK_ONLY": "1"})
    assert proc.returncode == 2 and "RECIPE=13b" in proc.stderr and "RECIPE=tiny" in proc.stderr, proc.stderr


def test_a_variant_value_may_be_a_json_object_with_commas():
    """gpu_speed_7b.sh's rc_liger_all sets Liger's kernels one by one: the changes split at the commas between keys
    only."""
    split = _load("recipe_proof").split_changes
    assert split('train.regional_compile=true,train.liger_kernel_config={"rms_norm":false,"rope":false},a.b=[1,2]') == [
        "train.regional_compile=true", 'train.liger_kernel_config={"rms_norm":false,"rope":false}', "a.b=[1,2]"]
    assert split('x="a,b",y=1') == ['x="a,b"', "y=1"] and split("") == []


def test_the_step_profile_sorts_kernels_into_categories_and_overlaps_count_once():
    profile = _load("step_profile")
    assert profile.busy_time([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17  # two streams overlapping, then a gap
    names = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "matmul",
             "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN": "matmul",
             "pytorch_flash::flash_bwd_kernel<Flash_bwd_kernel_traits<128, 64, 128>>": "attention",
             "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collectives",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...FusedAdamMathFunctor>": "optimizer",
             "_fused_linear_cross_entropy_kernel liger_cross_entropy_kernel": "loss",
             "_rms_norm_backward_kernel": "norms", "triton_poi_fused_add_mul_silu_0": "norms",
             "Memcpy DtoH (Device -> Pinned)": "copies", "aten::mm": "matmul", "cudaLaunchKernel": "other"}
    for name, expected in names.items():
        assert profile.category(name).startswith(expected), (name, profile.category(name))


def test_background_commands_run_in_turn_past_their_starter_under_one_deadline(tmp_path):
    script, run_dir = ROOT / "benchmarks" / "background.sh", tmp_path / "run"
    started = subprocess.run(["bash", script, "start", run_dir, "3", "echo a > $RESULTS/a.txt", "sleep 30",
                              "echo never"], capture_output=True, text=True, timeout=10)
    assert started.returncode == 0, started.stderr  # returned at once: the commands run on in their own session
    again = subprocess.run(["bash", script, "start", run_dir, "3", "true"], capture_output=True, text=True)
    assert again.returncode == 2 and "exists" in again.stderr
    done = subprocess.run(["bash", script, "wait", run_dir, "30", tmp_path / "r.tgz"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    status = [line.split(" ", 3) for line in (run_dir / "status").read_text().splitlines()]
    assert [s[:2] for s in status] == [["01", "0"], ["02", "124"], ["03", "skipped"]]  # the deadline cut the sleep
    assert (run_dir / "a.txt").read_text() == "a\n" and (tmp_path / "r.tgz").stat().st_size > 0
    fresh = subprocess.run(["bash", script, "wait", tmp_path / "none", "1"], capture_output=True, text=True)
    assert fresh.returncode == 3


def test_the_lora_table_gives_medians_over_the_runs_and_names_the_failed_ones():
    from pathlib import Path
    from types import SimpleNamespace

    bench = _load("lora_bench")
    args = SimpleNamespace(model_config=Path("llama3-8b"), seq_len=4096, global_batch=16, steps=6, warmup=2, rank=16,
                           variants=["lora", "full", "stock_peft"])

    def ok(rate, peak):
        return {"tokens_per_s_per_gpu": rate, "peak_allocated_gib": peak, "peak_reserved_gib": peak + 1,
                "trainable_params": 41_943_040}

    results = {"lora": [ok(13_000, 119.0), {"rc": 124}, ok(13_400, 119.6)], "full": [ok(4_000, 120.0)],
               "stock_peft": [{"rc": 1}]}
    rows = {line.split(" | ")[0].strip("| "): line for line in bench.report(args, results, {}).splitlines()
            if line.startswith("| ") and not line.startswith("| variant")}
    assert "| 13,200 (2 runs: 13,000-13,400) | 119.6 | 120.6 |" in rows["lora"] and "run 2 exit 124" in rows["lora"]
    assert "4,000 (1 run)" in rows["full"] and rows["full"].endswith("| none |")
    assert "failed (see stock_peft*.log)" in rows["stock_peft"] and "run 1 exit 1" in rows["stock_peft"]


def test_a_stock_lora_run_out_of_memory_steps_down_to_the_next_micro_batch_that_divides_the_global_batch(tmp_path):
    bench = _load("lora_bench")
    assert [bench.smaller_micro(m, 16) for m in (4, 2, 1, 6)] == [2, 1, None, 4]
    log = tmp_path / "stock_peft_nockpt.log"
    assert not bench.out_of_memory(log)
    log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 896.00 MiB\n")
    assert bench.out_of_memory(log)


def test_the_long_sequence_report_reads_each_run_and_names_the_longest_length_each_side_trained(tmp_path):
    """From the folders `gpu_long_seq_8b.sh` leaves: the committed 3B run (3 steps) as ours at 131,072, a stock run
    at 131,072 that ran out of memory, and one at 65,536 that trained."""
    import shutil

    measured = RESULTS / "2026-12-05_long-seq-3b-h100" / "00_ours_131072"
    runs = tmp_path / "runs"
    shutil.copytree(measured, runs / "00_ours_131072")
    (runs / "00_ours_131072" / "rc.txt").write_text("0\n")
    oom = runs / "01_stock_131072"
    oom.mkdir()
    (oom / "rc.txt").write_text("1\n")
    (oom / "stdout.log").write_text("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.77 GiB\n")
    shutil.copytree(measured, runs / "02_stock_65536")
    (runs / "02_stock_65536" / "rc.txt").write_text("0\n")
    table = _load("long_seq_bench").report(tmp_path, 3)
    assert "| ours 131,072 | trained 3 steps | 31.5 | 4,160 | 52.2 | 61.7 | 76.1 | 77.5 |" in table, table
    assert "| stock 131,072 | out of memory | - | - |" in table
    assert "ours 131,072, stock 65,536 (2.00x stock's length" in table


def test_the_committed_long_sequence_comparison_reads_back_as_committed():
    """The H100 comparison's runs as `gpu_long_seq_8b.sh` left them: a run that logged its steps and was then ended
    by its time limit trained; one stopped from outside before a step has no result."""
    folder = RESULTS / "2026-12-05_long-seq-3b-h100-vs-stock"
    table = _load("long_seq_bench").report(folder, 3)
    assert table == (folder / "long_seq.md").read_text()
    assert "| stock 196,608 | trained 3 steps (then exit 124) | 66.1 |" in table
    assert "| stock 229,376 | stopped from outside after 0 steps |" in table
    assert "ours 294,912, stock 196,608 (1.50x stock's length" in table


def test_the_stock_side_of_the_long_sequence_run_takes_the_least_offload_a_stock_script_can_set_that_fits():
    """The planner's options, fastest first: activation offload and checkpointing some layers only are ours, not a
    stock script's; the first fitting ZeRO-3 option with whole checkpointing gives its offload; our ds_config's
    activation offload block goes, and its ZeRO section is the stock template's, not the planner's tuning."""
    bench = _load("long_seq_bench")
    option = dict(stage=3, checkpointing=True, activation_offload=False, offload_param="none", fits=True, problems=[],
                  offload_optimizer="cpu", offload_optimizer_pin_memory=True, gpu_bytes=1)
    plan = {"options": [
        {**option, "option": "ZeRO-3 + offload optimizer (cpu, ratio 0.4) + checkpointing + activation offload",
         "activation_offload": True, "offload_optimizer_ratio": 0.4},
        {**option, "option": "ZeRO-3 + checkpointing (first 27 layers)", "offload_optimizer": "none",
         "offload_optimizer_ratio": 1.0},
        {**option, "option": "ZeRO-3 + offload optimizer (cpu, ratio 0.5) + checkpointing", "fits": False,
         "offload_optimizer_ratio": 0.5},
        {**option, "option": "ZeRO-3 + offload optimizer (cpu, ratio 0.7) + checkpointing",
         "offload_optimizer_ratio": 0.7},
    ]}
    ours = {"activation_checkpointing": {"cpu_checkpointing": True}, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.4},
                                  "stage3_param_persistence_threshold": 2**63 - 1}}
    template = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"}}
    stock = bench.stock_config(plan, ours, template)
    assert stock == {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": "auto",
        "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.7}}}
    for o in plan["options"]:  # none fits: the least GPU memory whose host RAM fits, to be tried
        o["fits"] = False
    plan["options"][3]["problems"] = ["host RAM needs 200 GB per node of 134 GB"]
    assert bench.stock_option(plan)["option"] == "ZeRO-3 + offload optimizer (cpu, ratio 0.5) + checkpointing"


def test_the_planned_lengths_table_names_what_each_side_fits_from_the_planner():
    """`long_seq_bench.py lengths`: the planner's own answers, run as the docs' command runs them."""
    table = _load("long_seq_bench").planned_lengths("tiny", [256], ["--gpus", "1", "--gpu-mem", "80GB", "--liger"])
    row = table.splitlines()[2]
    assert row.startswith("| 256 | ZeRO-3 ") and "checkpointing" in row.split(" | ")[1], table
    assert not row.endswith("| - |"), table  # ours fits on 80 GB
