"""hf_zero3.run.launch: the deepspeed command for each setting, errors that name the fix, the files written first."""

from __future__ import annotations

import shlex
import stat

import pytest

from hf_zero3.run.launch import forwarded_env, main, write_deepspeed_env, write_hostfile
from hf_zero3.run.launch_command import MULTI_NODE_PORT, LaunchError, Target, resolve
from tests.conftest import ROOT, plan_line

R70 = ROOT / "recipes" / "70b"
TARGET_70B = Target(1, 8, "40GB")


@pytest.fixture(autouse=True)
def from_repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # launch.sh runs from there; paths in the command are relative to it


@pytest.fixture
def hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# two nodes\nnode1 slots=4\nnode2 slots=4\n")
    return path


@pytest.fixture
def pdsh_path(tmp_path):
    """A PATH on which DeepSpeed's default multi-node backend (pdsh) is found."""
    (tmp_path / "bin").mkdir()
    tool = tmp_path / "bin" / "pdsh"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    return str(tmp_path / "bin")


def problems(env: dict, target: Target = TARGET_70B, recipe=R70) -> str:
    with pytest.raises(LaunchError) as info:
        resolve(recipe, [], env, target)
    return str(info.value)


def test_two_nodes_of_four_gpus_is_the_seeds_command(hosts, pdsh_path):
    launch = resolve(R70, [], {"NUM_NODES": "2", "NUM_GPUS": "4", "HOSTFILE": str(hosts), "PATH": pdsh_path},
                     TARGET_70B)
    assert shlex.join(launch.command) == (
        f"deepspeed --hostfile={hosts} --num_nodes=2 --num_gpus=4 --master_port={MULTI_NODE_PORT} "
        "train.py recipes/70b/train_args.yaml --deepspeed recipes/70b/ds_config.json")
    assert (launch.world_size, launch.remote_nodes, launch.new_hostfile) == (8, True, None)


def test_ssh_port_reaches_deepspeeds_runner(hosts, pdsh_path):
    """SSH_PORT becomes DeepSpeed's --ssh_port, which its pdsh runner passes to ssh as `-p`."""
    from deepspeed.launcher.runner import parse_args

    env = {"HOSTFILE": str(hosts), "NUM_GPUS": "4", "PATH": pdsh_path}
    launch = resolve(R70, [], {**env, "SSH_PORT": "2222"}, TARGET_70B)
    assert launch.command[1:5] == [f"--hostfile={hosts}", "--num_nodes=2", "--num_gpus=4", "--ssh_port=2222"]
    assert parse_args(launch.command[1:]).ssh_port == 2222  # DeepSpeed's own parser takes it
    assert not any(arg.startswith("--ssh_port") for arg in resolve(R70, [], env, TARGET_70B).command)


def test_defaults_come_from_the_target_and_one_node_takes_a_free_port():
    launch = resolve(R70, ["--max_steps", "3"], {}, TARGET_70B)
    assert launch.command[1:3] == ["--num_nodes=1", "--num_gpus=8"]
    port = int(launch.command[3].removeprefix("--master_port="))
    assert port != MULTI_NODE_PORT and launch.command[-2:] == ["--max_steps", "3"]
    assert (launch.world_size, launch.remote_nodes) == (8, False)
    tiny = resolve(ROOT / "recipes/tiny", [], {}, Target(1, 2))
    assert tiny.command[1:3] == ["--num_nodes=1", "--num_gpus=2"]  # recipes/tiny/launch.sh's default: 2 ranks


def test_model_selects_weights_and_from_config_random_weights():
    weights = resolve(R70, ["--lr", "1"], {"MODEL": "/models/llama-70b"}, TARGET_70B)
    assert weights.train_argv[3:] == ["--model_name_or_path", "/models/llama-70b", "--lr", "1"]  # user's last
    scratch = resolve(R70, [], {"FROM_CONFIG": "1"}, TARGET_70B)
    assert scratch.train_argv[3:] == ["--model_name_or_path", "null", "--config_name", "meta-llama/Llama-2-70b-hf"]


def test_model_replaces_a_from_scratch_recipes_config_overrides_and_tokenizer():
    """recipes/10b-h200x1 trains from scratch (config_name + config_overrides + tokenizer_name); MODEL= must not
    reshape the user's model to 48 layers or swap its tokenizer (a 2-layer MODEL trained as 10.7B on the GPU box)."""
    recipe, target = ROOT / "recipes" / "10b-h200x1", Target(1, 1, "140GB")
    weights = resolve(recipe, [], {"MODEL": "/models/solar"}, target)
    assert weights.train_argv[3:] == ["--model_name_or_path", "/models/solar", "--config_name", "null",
                                      "--config_overrides", "null", "--tokenizer_name", "null"]
    shape_of_model = resolve(recipe, [], {"MODEL": "/models/solar", "FROM_CONFIG": "1"}, target)
    assert shape_of_model.train_argv[3:] == ["--model_name_or_path", "null", "--config_name", "/models/solar",
                                             "--config_overrides", "null", "--tokenizer_name", "null"]
    recipes_shape = resolve(recipe, [], {"FROM_CONFIG": "1"}, target)
    assert recipes_shape.train_argv[3:] == ["--model_name_or_path", "null", "--config_name", "assets/tiny/model"]


def test_hosts_writes_a_hostfile_with_num_gpus_slots(tmp_path):
    path = tmp_path / "out" / "hostfile"
    launch = resolve(R70, [], {"HOSTS": "a,b", "NUM_GPUS": "4", "HOSTFILE": str(path), "DRY_RUN": "1"}, TARGET_70B)
    assert launch.new_hostfile == {"a": 4, "b": 4} and launch.nodes == 2 and launch.world_size == 8
    assert f"--hostfile={path}" in launch.command
    write_hostfile(path, launch.new_hostfile)
    assert path.read_text() == "a slots=4\nb slots=4\n"
    assert [p.name for p in path.parent.iterdir()] == ["hostfile"]  # no temporary left behind


def test_no_ssh_node_launch(hosts):
    env = {"HOSTFILE": str(hosts), "NUM_GPUS": "4", "NO_SSH": "1", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    launch = resolve(R70, [], env, TARGET_70B)
    assert launch.command[:7] == ["deepspeed", f"--hostfile={hosts}", "--num_nodes=2", "--num_gpus=4", "--no_ssh",
                                  "--node_rank=1", "--master_addr=10.0.0.1"]
    assert launch.command[7] == f"--master_port={MULTI_NODE_PORT}"  # every node must agree: no random port
    assert not launch.remote_nodes  # this node only: no pdsh, no .deepspeed_env


def test_include_exclude_replace_the_counts(hosts, pdsh_path):
    launch = resolve(R70, [], {"HOSTFILE": str(hosts), "INCLUDE": "node1:0,1@node2", "PATH": pdsh_path}, TARGET_70B)
    assert launch.command[1:3] == [f"--hostfile={hosts}", "--include=node1:0,1@node2"]
    assert not any(a.startswith(("--num_nodes", "--num_gpus")) for a in launch.command)
    assert launch.world_size == 6  # DeepSpeed's own resolution of the filter
    assert "INCLUDE: Hostname 'node9' not found" in problems({"HOSTFILE": str(hosts), "INCLUDE": "node9"})


def test_openmpi_runs_the_whole_hostfile_without_counts(hosts, tmp_path, monkeypatch):
    (tmp_path / "ompi_info").write_text("#!/bin/sh\n")
    (tmp_path / "ompi_info").chmod(0o755)
    env = {"HOSTFILE": str(hosts), "NUM_GPUS": "4", "LAUNCHER": "openmpi", "PATH": str(tmp_path)}
    assert "LAUNCHER=openmpi: DeepSpeed reads each rank's place from MPI through mpi4py, which is not installed " \
           "here: pip install mpi4py on every node" in problems(env)
    (tmp_path / "site" / "mpi4py").mkdir(parents=True)  # a stand-in: what matters here is that it is importable
    (tmp_path / "site" / "mpi4py" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    launch = resolve(R70, [], {"HOSTFILE": str(hosts), "NUM_GPUS": "4", "LAUNCHER": "openmpi",
                               "PATH": str(tmp_path)}, TARGET_70B)
    assert "--launcher=openmpi" in launch.command and "--num_gpus=4" not in launch.command  # DeepSpeed refuses them
    assert launch.world_size == 8
    assert "LAUNCHER=openmpi runs every slot" in problems({"HOSTFILE": str(hosts), "NUM_NODES": "1", "NUM_GPUS": "4",
                                                           "LAUNCHER": "openmpi"})


def test_wrong_combinations_are_all_reported_with_their_fix(hosts):
    text = problems({"NUM_NODES": "3", "NUM_GPUS": "8", "HOSTFILE": str(hosts), "NO_SSH": "1", "LAUNCHER": "mpich"})
    lines = text.splitlines()
    assert f"NUM_NODES=3 but {hosts} lists 2 host(s): set NUM_NODES=2 or add hosts to the hostfile" in lines
    assert f"NUM_GPUS=8 but {hosts} gives node1 4 slot(s), node2 4 slot(s): set NUM_GPUS=4 or fix the slots" in lines
    assert "NO_SSH=1 needs NODE_RANK: this node's index (0..2) in the hostfile" in lines
    assert any(line.startswith("NO_SSH=1 needs MASTER_ADDR") for line in lines)
    assert any(line.startswith("LAUNCHER=mpich is not supported: use pdsh, openmpi,") for line in lines)
    assert len(lines) == 6  # + LAUNCHER unused with NO_SSH


@pytest.mark.parametrize("env, expected", [
    ({"NUM_NODES": "2"}, "NUM_NODES=2 needs the hosts: set HOSTFILE=path"),
    ({"NUM_NODES": "2", "HOSTFILE": "/nonexistent/hosts"}, "HOSTFILE=/nonexistent/hosts does not exist"),
    ({"NUM_NODES": "two"}, "NUM_NODES=two is not a whole number >= 1"),
    ({"NUM_GPUS": "0"}, "NUM_GPUS=0 is not a whole number >= 1"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a whole number 1..65535"),
    ({"SSH_PORT": "22x"}, "SSH_PORT=22x is not a whole number 1..65535: fix or unset it"),
    ({"SSH_PORT": "2222", "NO_SSH": "1"}, "SSH_PORT is unused with NO_SSH=1"),
    ({"NODE_RANK": "1"}, "NODE_RANK is only used with NO_SSH=1"),
    ({"NO_SSH": "maybe"}, "NO_SSH=maybe is not a switch"),
    ({"INCLUDE": "a", "EXCLUDE": "b"}, "INCLUDE and EXCLUDE are both set"),
    ({"INCLUDE": "localhost:0", "NUM_GPUS": "2"}, "unset NUM_GPUS"),
    ({"HOSTS": "a,a"}, "names a host twice"),
])
def test_each_bad_setting_names_its_fix(env, expected):
    assert expected in problems(env)


def test_bad_hostfile_lines_are_named(tmp_path):
    bad = tmp_path / "hosts"
    bad.write_text("node1 slots=4\nnode2 4\n")
    assert f"HOSTFILE: {bad}:2: 'node2 4' is not `hostname slots=N`" in problems({"HOSTFILE": str(bad)})


def test_several_nodes_need_the_launchers_backend_on_this_node(hosts, tmp_path):
    text = problems({"HOSTFILE": str(hosts), "NUM_GPUS": "4", "PATH": str(tmp_path)})
    assert "LAUNCHER=pdsh needs `pdsh` on this node" in text and "NO_SSH=1" in text


def test_not_a_recipe_folder(tmp_path):
    text = problems({}, recipe=tmp_path)
    assert f"{tmp_path} has no train_args.yaml: pass a recipe folder (recipes/<name>: 10b-h200x1, 13b, 20b-h200x2, 70b, 70b-dpo-lora, 70b-lora, 7b, 8b, 8b-dpo, qwen3-30b-a3b, tiny)" in text


def test_main_prints_every_problem_and_launches_nothing(capsys, tmp_path):
    assert main([str(R70)], {"NUM_NODES": "2", "NUM_GPUS": "0"}) == 2
    err = capsys.readouterr().err
    assert err.count("error: ") == 2 and "NUM_GPUS=0" in err and "NUM_NODES=2 needs the hosts" in err


def test_deepspeed_env_carries_the_forwarded_variables_and_keeps_the_users_lines(tmp_path):
    env = {"HF_TOKEN": "hf_x", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "info", "NCCL_DEBUG": "INFO",
           "NCCL_SOCKET_IFNAME": "^lo,docker0", "TORCH_EXTENSIONS_DIR": "/x y", "OMP_NUM_THREADS": "8",
           "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0", "HF_BROKEN": "a\nb", "HF_QUOTE": 'say "hi"'}
    variables, skipped = forwarded_env(env)
    assert list(variables) == ["HF_HUB_OFFLINE", "HF_TOKEN", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS",
                               "TORCH_EXTENSIONS_DIR", "TRANSFORMERS_VERBOSITY"]
    assert skipped == ["HF_BROKEN", "HF_QUOTE"]
    path = tmp_path / ".deepspeed_env"
    path.write_text("MY_SETTING=kept=1\nNCCL_IB_HCA=mlx5_0\nNCCL_DEBUG=WARN\n")  # the user's own lines
    write_deepspeed_env(path, variables)
    pairs = [line.split("=", 1) for line in path.read_text().splitlines()]  # how DeepSpeed's runner reads it
    assert dict(pairs) == {"MY_SETTING": "kept=1", "NCCL_IB_HCA": "mlx5_0", **variables}  # this env wins
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # HF_TOKEN is in there
    del variables["HF_TOKEN"]  # unset since: the line we wrote goes, the user's lines stay
    write_deepspeed_env(path, variables)
    assert dict(line.split("=", 1) for line in path.read_text().splitlines()) == {
        "MY_SETTING": "kept=1", "NCCL_IB_HCA": "mlx5_0", **variables}


@pytest.mark.parametrize("text, expected", [("1x8x40GB", Target(1, 8, "40GB")), ("2x4", Target(2, 4, None)),
                                            ("1x2x141GB", Target(1, 2, "141GB"))])
def test_target_parses(text, expected):
    assert Target.parse(text) == expected


@pytest.mark.parametrize("text", ["8", "0x8", "1x8x", "1x8xlots", "1x8x40ZB"])
def test_bad_target_is_refused(text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="NODESxGPUS"):
        Target.parse(text)


def test_dry_run_plans_with_liger_when_the_run_uses_it(capsys):
    """`use_liger_kernel: true` (YAML or override) reaches the memory plan: smaller layers; the loss is TRL's fused
    LM head either way (SFTTrainer turns Liger's fused cross-entropy off)."""
    argv = ["--target", "1x2x140GiB", str(ROOT / "recipes" / "8b"), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "3"]
    main([*argv, "--use_liger_kernel", "false"], {"DRY_RUN": "1"})
    plain = capsys.readouterr().out
    main([*argv, "--use_liger_kernel", "true"], {"DRY_RUN": "1"})
    liger = capsys.readouterr().out
    assert "Liger" not in plan_line(plain, "plan") and ", Liger" in plan_line(liger, "plan")
    for out in (plain, liger):
        assert "fused LM head + loss (TRL, in tiles)" in out and "fused linear cross-entropy (Liger)" not in out
        assert "logits + loss (fp32 cross-entropy)" not in out
    gpu = lambda out: float(plan_line(out, "recipe").removeprefix("8b: ").split(" GB per GPU")[0].split(": ")[-1])
    assert gpu(plain) - gpu(liger) > 15  # Liger's norms and SwiGLU (the plain plan fits only tightly: less margin)


def test_dry_run_on_one_gpu_says_the_planner_keeps_every_parameter_whole(capsys, tmp_path):
    """On one GPU the planner's config persists every parameter; a recipe config that does not hears of it once."""
    import json

    from hf_zero3.config.spec import EVERY_PARAMETER

    argv = ["--target", "1x1x141GiB", str(ROOT / "recipes" / "7b"), "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "16", "--use_liger_kernel", "true"]
    config = json.loads((ROOT / "recipes" / "tiny" / "ds_config.json").read_text())  # ZeRO-3, threshold "auto"
    (tmp_path / "zero3.json").write_text(json.dumps(config))
    main([*argv, "--deepspeed", str(tmp_path / "zero3.json")], {"DRY_RUN": "1", "HOST_RAM": "125GiB"})
    told = capsys.readouterr().out
    assert f"the planner also sets stage3_param_persistence_threshold: {EVERY_PARAMETER}" in told
    config["zero_optimization"]["stage3_param_persistence_threshold"] = EVERY_PARAMETER
    (tmp_path / "zero3.json").write_text(json.dumps(config))
    main([*argv, "--deepspeed", str(tmp_path / "zero3.json")], {"DRY_RUN": "1", "HOST_RAM": "125GiB"})
    assert "the planner also sets" not in capsys.readouterr().out
    config["zero_optimization"].update(stage3_param_persistence_threshold="auto", offload_param={"device": "cpu"})
    (tmp_path / "zero3.json").write_text(json.dumps(config))  # parameters on the host: persisting them is not free
    main([*argv, "--deepspeed", str(tmp_path / "zero3.json")], {"DRY_RUN": "1", "HOST_RAM": "125GiB"})
    assert "the planner also sets" not in capsys.readouterr().out


def test_a_bad_gpu_mem_names_the_setting_not_a_plan_flag(capsys):
    """GPU_MEM is the launcher's setting: its error says GPU_MEM and the size grammar (it used to be re-parsed as
    `hf-zero3 plan --gpu-mem` and reported as that flag)."""
    rc = main(["--target", "1x2", str(ROOT / "recipes" / "8b")], {"DRY_RUN": "1", "GPU_MEM": "40XB"})
    err = capsys.readouterr().err
    assert rc == 2 and "GPU_MEM=40XB: bad size '40XB'" in err and "80GiB" in err and "--gpu-mem" not in err


def test_a_dry_run_with_a_missing_ds_config_override_says_so_without_a_traceback(tmp_path, capsys):
    """`--deepspeed PATH` on the launch line replaces the recipe's config; a path that is not there is one error line."""
    missing = tmp_path / "nope.json"
    rc = main(["--target", "1x2", str(ROOT / "recipes" / "8b"), "--deepspeed", str(missing)], {"DRY_RUN": "1"})
    err = capsys.readouterr().err
    assert rc == 2 and f"ds_config {missing} not found" in err and "Traceback" not in err


def test_slurm_node_lists_and_the_slurm_launcher_are_refused_with_what_works(hosts):
    text = problems({"HOSTS": "gpu-[01-03,07]", "NUM_GPUS": "4"})
    assert 'HOSTS=gpu-[01-03,07] is a SLURM node list, which HOSTS does not expand: pass the names, e.g. ' \
           'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,)' in text.splitlines()
    assert "starts one srun task per rank" in problems({"HOSTFILE": str(hosts), "LAUNCHER": "slurm"}) and \
        "scripts/slurm/train.sbatch" in problems({"HOSTFILE": str(hosts), "LAUNCHER": "slurm"})


LONG = ["--target", "1x2x80GiB", str(ROOT / "recipes" / "8b"), "--block_size", "393216", "--attn_implementation",
        "sdpa", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1"]


def test_dry_run_plans_the_sequence_parallelism_a_long_block_size_needs(capsys):
    """A block size that fits no option as set: the dry run answers as `plan --seq-len` does."""
    assert main(LONG, {"DRY_RUN": "1"}) == 1  # the recipe's own config does not fit; the plan says what does
    out = capsys.readouterr().out
    assert "length    sequence_parallel_size 1, tiled_compute false (393216 tokens per rank): does not fit" in out
    assert "length    393216 tokens: per token" in out
    assert "length    chosen: sequence_parallel_size 2" in out
    assert "--sequence_parallel_size 2" in plan_line(out, "TrainingArguments:")
    main([*LONG, "--stage", "dpo"], {"DRY_RUN": "1"})  # pairs: sequence parallelism runs stage sft only
    out = capsys.readouterr().out
    assert "length    393216 tokens: per token" in out and "sequence_parallel_size 2" not in out


def test_dry_run_plans_one_ranks_share_under_sequence_parallelism_and_tiling(capsys):
    main(LONG, {"DRY_RUN": "1"})
    alone = capsys.readouterr().out
    main([*LONG, "--sequence_parallel_size", "2", "--tiled_compute", "true"], {"DRY_RUN": "1"})
    out = capsys.readouterr().out
    head = plan_line(out, "plan")
    assert "seq 393216 (196608 per rank: sequence parallel 2)" in head and "tiled compute" in head
    assert "x 1 data-parallel ranks (2 ranks / sequence parallel 2) = global batch 1" in head
    assert "--sequence_parallel_size 2 --tiled_compute true" in plan_line(out, "TrainingArguments:")
    assert plan_line(out, "choice").endswith("x 1 data-parallel ranks (2 GPUs / sequence parallel 2) = global batch 1")
    assert "length " not in out  # the run sets both: planned as set
    gpu = lambda text: float(plan_line(text, "recipe").split(": ")[2].split(" GB per GPU")[0].replace(",", ""))
    assert gpu(out) < 0.55 * gpu(alone)  # half the tokens per rank (and the MLPs tiled)


def test_dry_run_plans_the_stage_of_the_yaml_or_command_line_not_sft(capsys):
    """`stage: dpo` reaches the planner: chosen and rejected in one forward and the reference model's partition (none
    with precomputed log-probs), in the planner's choice and in the recipe's own plan."""
    # micro 4: the activations set the peak (at micro 1 TRL's fused LM head leaves the optimizer step the peak)
    argv = ["--target", "1x1x141GiB", str(ROOT / "recipes" / "8b"), "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "4", "--gradient_checkpointing", "true", "--use_liger_kernel", "false"]
    env = {"DRY_RUN": "1", "HOST_RAM": "125GiB"}
    gpu = lambda out: float(plan_line(out, "recipe").split(" GB per GPU")[0].split(": ")[-1])
    main(argv, env)
    sft = capsys.readouterr().out
    main([*argv, "--stage", "dpo"], env)
    dpo = capsys.readouterr().out
    main([*argv, "--stage", "dpo", "--stage_args", '{"precompute_ref_log_probs": true}'], env)
    precomputed = capsys.readouterr().out
    assert "stage" not in plan_line(sft, "plan") and "reference model" not in sft
    assert plan_line(dpo, "plan").endswith(", stage dpo")
    assert "reference model, 16-bit (dpo)" in dpo and "chosen and rejected in one forward" in dpo
    assert plan_line(precomputed, "plan").endswith(", stage dpo (reference log-probs precomputed)")
    assert "reference model, 16-bit" not in precomputed and "chosen and rejected in one forward" in precomputed
    reference = 2 * 8.03  # GB: the 16-bit reference on one GPU
    assert gpu(dpo) - gpu(precomputed) > reference > 0 and gpu(precomputed) > gpu(sft)
