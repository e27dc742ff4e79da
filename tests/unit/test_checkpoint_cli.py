"""`hf-zero3 export | reshard | push`: every user mistake exits 2 with a message naming the fix, no traceback, and
nothing written. Push failures go through a real HTTP server on 127.0.0.1 (and a closed port) via HF_ENDPOINT."""

from __future__ import annotations

import json
import secrets
import socket
from pathlib import Path

import pytest
import torch

from hf_zero3.checkpoint import contents
from hf_zero3.checkpoint import lifecycle as ckpt
from hf_zero3.checkpoint.lifecycle import is_complete, write_marker
from hf_zero3.cli import build_parser
from hf_zero3.cli import main as cli_main
from tests.conftest import error_naming, explain, run
from tests.hub_server import LocalHub

TOKEN = "hf_" + secrets.token_hex(16)


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def cli(capsys, *args: str) -> tuple[int, str]:
    """In process: an uncaught exception fails the test, so a return code means no traceback."""
    try:
        code = cli_main([str(a) for a in args])
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out + err


@pytest.fixture
def broken_checkpoint(tmp_path) -> Path:
    """Complete by its marker (every listed file there with its size), but its DeepSpeed shards are garbage."""
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / "global_step2").mkdir(parents=True)
    (checkpoint / "latest").write_text("global_step2")
    for name in ("zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (checkpoint / "global_step2" / name).write_bytes(b"not a torch file")
    (checkpoint / "config.json").write_text("{}")
    write_marker(checkpoint, {})
    assert is_complete(checkpoint)
    return checkpoint


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("1GiB", 2**30),
                                       ("512M", 512 * 2**20)])
def test_shard_size_takes_the_planners_size_grammar(text, size):
    assert build_parser().parse_args(["export", "ckpt", "out", "--shard-size", text]).shard_size == size


@pytest.mark.parametrize("text,names", [
    ("2e9", ["--shard-size", "'2e9'", "a number with a unit", "40GB"]),
    ("garbage", ["--shard-size", "'garbage'", "a number with a unit"]),
    ("", ["--shard-size", "''", "a number with a unit"]),
    ("0GB", ["shard size 0", "not positive", "5GB"]),
])
def test_bad_shard_size_is_refused_before_anything_is_written(capsys, broken_checkpoint, tmp_path, text, names):
    before = tree(tmp_path)
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "out", "--shard-size", text)
    assert code == 2, output
    error_naming(output, *names)
    assert tree(tmp_path) == before


def test_failed_export_leaves_no_staging_folder_nor_the_folders_it_created(capsys, broken_checkpoint, tmp_path):
    before = tree(tmp_path)
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "new" / "deeper" / "out")
    assert code == 2, output
    error_naming(output, f"error: export of {broken_checkpoint}", "nothing written", "UnpicklingError")
    assert "export another complete checkpoint" in output
    assert tree(tmp_path) == before  # no .out.partial, no new/deeper


def test_unwritable_output_folder_is_named(capsys, broken_checkpoint, tmp_path):
    (tmp_path / "a-file").write_text("")
    before = tree(tmp_path)
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "a-file" / "out")
    assert code == 2, output
    error_naming(output, f"error: cannot create {tmp_path / 'a-file' / '.out.partial'}", "Not a directory", "choose")
    assert tree(tmp_path) == before


def test_a_staging_folder_hf_zero3_did_not_leave_is_never_deleted(capsys, broken_checkpoint, tmp_path):
    foreign = tmp_path / ".out.partial"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone's")
    before = tree(tmp_path)
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "out")
    assert code == 2 and f"error: {foreign} exists and was not left by hf-zero3" in output, output
    assert "nothing was deleted" in output
    assert tree(tmp_path) == before and (foreign / "notes.txt").read_text() == "someone's"


def test_a_staging_folder_left_by_a_killed_export_is_cleared(capsys, broken_checkpoint, tmp_path):
    before = tree(tmp_path)
    leftover = tmp_path / ".out.partial"
    leftover.mkdir()
    (leftover / "model-00001-of-00002.safetensors").write_text("half written")
    leftover.with_name(".out.partial.owner").write_text("hf-zero3 staging folder")
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "out")
    assert code == 2 and "failed, nothing written" in output, output  # the checkpoint is broken, not the leftover
    assert tree(tmp_path) == before  # the leftover and its owner file are gone, nothing new is left


def test_failed_reshard_leaves_no_staging_folder(capsys, broken_checkpoint, tmp_path):
    before = tree(tmp_path)
    code, output = cli(capsys, "reshard", broken_checkpoint, "--workers", "1")
    assert code == 2, output
    error_naming(output, f"error: reshard of {broken_checkpoint}", "nothing written")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("verb", [["export", "{input}", "{out}"], ["reshard", "{input}"],
                                  ["push", "{input}", "--repo-id", "org/name"]])
@pytest.mark.parametrize("kind", ["missing", "a file", "empty folder"])
def test_unusable_input_is_named(capsys, tmp_path, verb, kind):
    given = tmp_path / "input"
    if kind == "a file":
        given.write_text("x")
    elif kind == "empty folder":
        given.mkdir()
    before = tree(tmp_path)
    code, output = cli(capsys, *[a.format(input=given, out=tmp_path / "out") for a in verb])
    assert code == 2 and output.startswith("error: ") and str(given) in output, output
    assert tree(tmp_path) == before


@pytest.mark.parametrize("repo_id", ["a/b/c", "org/my model", "!!", "", "/name", "org/", "name", "org//name",
                                     "org/na--me", "org/" + "x" * 100])
def test_every_invalid_repo_id_is_refused_with_the_form(capsys, tmp_path, repo_id):
    code, output = cli(capsys, "push", tmp_path / "not-even-a-folder", "--repo-id", repo_id)
    assert code == 2, output
    assert output.startswith("error: "), output
    error_naming(output.splitlines()[0], f"--repo-id {repo_id!r}", "ORG/NAME", "my-org/llama-8b-sft")


@pytest.fixture
def exported(tmp_path) -> Path:
    """The smallest folder a push accepts: non-empty weights and a config."""
    from safetensors.torch import save_file

    folder = tmp_path / "export"
    folder.mkdir()
    save_file({"w": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    return folder


@pytest.fixture
def hub():
    server = LocalHub(token=TOKEN)
    yield server
    server.close()


def push(folder: Path, hub_or_endpoint, tmp_path: Path, repo_id: str = "org/name", token: str = TOKEN):
    env = hub_or_endpoint.env(token) if isinstance(hub_or_endpoint, LocalHub) else {
        "HF_ENDPOINT": hub_or_endpoint, "HF_TOKEN": token, "HF_HUB_DISABLE_TELEMETRY": "1"}
    return run(["python", "-m", "hf_zero3", "push", folder, "--repo-id", repo_id], timeout=180,
               HF_HOME=str(tmp_path / "hf_home"), **env)


def one_line_error(proc) -> str:
    """The push's failure as the user sees it: exit 2, no traceback, one `error:` line, no token anywhere."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, explain(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, explain(proc)
    assert TOKEN not in proc.stdout + proc.stderr
    return errors[0]


def test_push_sends_the_weights_through_lfs_as_the_hub_does(exported, hub, tmp_path):
    proc = push(exported, hub, tmp_path)
    assert proc.returncode == 0, explain(proc)
    (commit,) = hub.commits
    assert commit["lfs"] == ["model.safetensors"] and hub.puts == 1  # PUT to the LFS URL, named by sha256
    assert commit["files"]["model.safetensors"] == (exported / "model.safetensors").read_bytes()
    assert commit["files"]["config.json"] == b"{}"
    assert hub.auth == {f"Bearer {TOKEN}"} and TOKEN not in proc.stdout + proc.stderr
    error_naming(proc.stderr, "push: 2 files", "0.00 GB", "org/name")


def test_push_refused_by_the_hub_names_hf_token_and_login(exported, hub, tmp_path):
    error = one_line_error(push(exported, hub, tmp_path, token="hf_" + secrets.token_hex(16)))
    error_naming(error, f"the Hub at {hub.url}", "HTTP 401", "set HF_TOKEN", "`hf auth login`")


def test_push_to_an_org_the_token_cannot_write_to_names_the_org_and_the_token(exported, tmp_path):
    hub = LocalHub(token=TOKEN, forbidden=("org",))
    try:
        error = one_line_error(push(exported, hub, tmp_path))
    finally:
        hub.close()
    error_naming(error, f"the Hub at {hub.url}", "org/name", "HTTP 403", "write access to org", "HF_TOKEN",
                 "`hf auth login`")
    assert hub.commits == [] and hub.puts == 0


def test_push_to_a_repo_that_is_not_there_names_the_repo_id_and_the_token(exported, tmp_path):
    hub = LocalHub(token=TOKEN, noop_create=True)  # created, then gone (deleted meanwhile) when the upload starts
    try:
        error = one_line_error(push(exported, hub, tmp_path))
    finally:
        hub.close()
    error_naming(error, f"the Hub at {hub.url}", "org/name", "HTTP 404", "repo id", "HF_TOKEN", "of org")


def test_an_interrupted_upload_says_nothing_was_committed_and_to_push_again(exported, tmp_path):
    hub = LocalHub(token=TOKEN, interrupt_uploads=True)  # huggingface_hub retries the PUT 5 times (~25 s)
    try:
        error = one_line_error(push(exported, hub, tmp_path))
        assert hub.puts >= 2 and hub.commits == []
        hub.interrupt_uploads = False
        again = push(exported, hub, tmp_path)
    finally:
        hub.close()
    error_naming(error, f"the Hub at {hub.url}", "interrupted", "nothing was committed to org/name",
                 "run the same push again")
    assert again.returncode == 0 and hub.commits[0]["lfs"] == ["model.safetensors"], explain(again)


def test_push_to_an_unreachable_hub_names_hf_endpoint_and_the_network(exported, tmp_path):
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening, so the connection is refused
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        proc = push(exported, endpoint, tmp_path)
    error = one_line_error(proc)
    error_naming(error, f"cannot reach the Hub at {endpoint}", "Connection refused", "check the network",
                 "HF_ENDPOINT", "https://huggingface.co")


def test_a_sharded_push_over_a_single_file_one_removes_the_old_weights(exported, hub, tmp_path):
    """upload_folder only adds: a model.safetensors left beside a new sharded index is what from_pretrained loads."""
    from safetensors.torch import save_file

    assert push(exported, hub, tmp_path).returncode == 0
    hub.files[("org/name", "main")]["adapter_model.safetensors"] = b"the user's"  # not ours to remove
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for i, name in enumerate(("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
        save_file({f"w{i}": torch.full((2, 2), 2.0)}, str(sharded / name))
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"w0": "model-00001-of-00002.safetensors",
                                        "w1": "model-00002-of-00002.safetensors"}}))
    (sharded / "config.json").write_text("{}")
    proc = push(sharded, hub, tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert hub.commits[-1]["deleted"] == ["model.safetensors"]
    assert sorted(hub.files[("org/name", "main")]) == ["adapter_model.safetensors", "config.json",
                                                       "model-00001-of-00002.safetensors",
                                                       "model-00002-of-00002.safetensors",
                                                       "model.safetensors.index.json"]


@pytest.mark.parametrize("where", ["inside", "dot", "link"])
def test_export_takes_the_folder_a_path_names_and_never_one_inside_the_checkpoint(tmp_path, monkeypatch, where):
    from hf_zero3.checkpoint.export import export_checkpoint
    from tests.conftest import make_checkpoint

    folder = make_checkpoint(tmp_path / "run", 2)
    if where == "inside":  # keep-last-N would delete it with the checkpoint
        with pytest.raises(ckpt.CheckpointError, match="is inside .*checkpoint-2, which keep-last-N deletes"):
            export_checkpoint(folder, folder / "hf")
        assert not (folder / "hf").exists()
        return
    target = tmp_path / "elsewhere" / "hf"
    target.mkdir(parents=True)
    if where == "dot":
        monkeypatch.chdir(target)
        out = export_checkpoint(folder, ".")
    else:
        (tmp_path / "link").symlink_to(target)
        out = export_checkpoint(folder, tmp_path / "link")
    assert out == target and (target / "model.safetensors").is_file() and contents.verify_weights(target, folder) == []


def test_an_adapter_folder_pushes_its_adapter_and_leaves_the_repo_s_model_weights(hub, tmp_path):
    """A LoRA export (adapter_config.json, adapter_model.safetensors) pushes without a config.json; model weights
    already in the repo are the user's to keep."""
    from safetensors.torch import save_file

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file({"base_model.model.layers.0.q_proj.lora_A.weight": torch.ones(2, 4),
               "base_model.model.layers.0.q_proj.lora_B.weight": torch.ones(4, 2)},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    hub.files[("org/name", "main")] = {"model.safetensors": b"the user's"}
    proc = push(adapter, hub, tmp_path)
    assert proc.returncode == 0, explain(proc)
    assert hub.commits[-1]["deleted"] == []
    assert sorted(hub.files[("org/name", "main")]) == ["adapter_config.json", "adapter_model.safetensors",
                                                       "model.safetensors"]
