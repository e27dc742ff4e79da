"""`hf-zero3 export | reshard | push`: every user mistake exits 2 with a message naming the fix, no traceback, and
nothing written. Push failures go through a real HTTP server on 127.0.0.1 (and a closed port) via HF_ENDPOINT."""

from __future__ import annotations

import secrets
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hf_zero3.checkpoint.lifecycle import is_complete, write_marker
from hf_zero3.cli import build_parser
from hf_zero3.cli import main as cli_main
from tests.conftest import explain, run

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


@pytest.mark.parametrize("text,message", [
    ("2e9", "argument --shard-size: bad size '2e9': give a number with a unit, e.g. 40GB (10^9 bytes), 80GiB"),
    ("garbage", "argument --shard-size: bad size 'garbage': give a number with a unit"),
    ("", "argument --shard-size: bad size '': give a number with a unit"),
    ("0GB", "error: shard size 0 is not positive: give one of at least 1 byte, e.g. 5GB, 500MB or 1GiB"),
])
def test_bad_shard_size_is_refused_before_anything_is_written(capsys, broken_checkpoint, tmp_path, text, message):
    before = tree(tmp_path)
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "out", "--shard-size", text)
    assert code == 2 and message in output, output
    assert tree(tmp_path) == before


def test_failed_export_leaves_no_staging_folder_nor_the_folders_it_created(capsys, broken_checkpoint, tmp_path):
    before = tree(tmp_path)
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "new" / "deeper" / "out")
    assert code == 2, output
    assert f"error: export of {broken_checkpoint} failed, nothing written: UnpicklingError" in output
    assert "export another complete checkpoint" in output
    assert tree(tmp_path) == before  # no .out.partial, no new/deeper


def test_unwritable_output_folder_is_named(capsys, broken_checkpoint, tmp_path):
    (tmp_path / "a-file").write_text("")
    before = tree(tmp_path)
    code, output = cli(capsys, "export", broken_checkpoint, tmp_path / "a-file" / "out")
    assert code == 2 and f"error: cannot create {tmp_path / 'a-file' / '.out.partial'}: Not a directory: choose" \
        in output, output
    assert tree(tmp_path) == before


def test_failed_reshard_leaves_no_staging_folder(capsys, broken_checkpoint, tmp_path):
    before = tree(tmp_path)
    code, output = cli(capsys, "reshard", broken_checkpoint, "--workers", "1")
    assert code == 2 and f"error: reshard of {broken_checkpoint} failed, nothing written" in output, output
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
    assert output.startswith(f"error: --repo-id {repo_id!r} is not ORG/NAME: set --repo-id to ORG/NAME, e.g. "
                             "my-org/llama-8b-sft (one `/` between"), output


@pytest.fixture
def exported(tmp_path) -> Path:
    """The smallest folder a push accepts: non-empty weights and a config."""
    from safetensors.torch import save_file

    folder = tmp_path / "export"
    folder.mkdir()
    save_file({"w": torch.ones(2, 2)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text("{}")
    return folder


class Refusing(BaseHTTPRequestHandler):
    """A Hub that answers 401 to everything, as huggingface.co does without a valid token."""

    def log_message(self, *args):
        pass

    def _refuse(self):
        body = b'{"error": "Invalid credentials in Authorization header"}'
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_HEAD = _refuse


def push(folder: Path, endpoint: str, tmp_path: Path):
    return run(["python", "-m", "hf_zero3", "push", folder, "--repo-id", "org/name"], timeout=120,
               HF_ENDPOINT=endpoint, HF_TOKEN=TOKEN, HF_HOME=str(tmp_path / "hf_home"),
               HF_HUB_DISABLE_TELEMETRY="1")


def test_push_refused_by_the_hub_names_hf_token_and_login(exported, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = push(exported, f"http://127.0.0.1:{server.server_address[1]}", tmp_path)
    finally:
        server.shutdown()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, explain(proc)
    assert f"error: the Hub at http://127.0.0.1:{server.server_address[1]} refused the request as unauthenticated " \
           "(HTTP 401): set HF_TOKEN to a token with write access, or run `hf auth login`" in proc.stderr
    assert TOKEN not in proc.stdout + proc.stderr


def test_push_to_an_unreachable_hub_names_hf_endpoint_and_the_network(exported, tmp_path):
    with socket.socket() as sock:  # a port nobody listens on: bound, never listening, so the connection is refused
        sock.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
        proc = push(exported, endpoint, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, explain(proc)
    assert f"error: cannot reach the Hub at {endpoint} (" in proc.stderr and "Connection refused" in proc.stderr
    assert "check the network, and HF_ENDPOINT" in proc.stderr
