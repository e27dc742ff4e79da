"""One hostfile parser (doctor and launch) whose verdict is DeepSpeed's own, with errors that name line and fix."""

from __future__ import annotations

import pytest
from deepspeed.launcher.runner import fetch_hostfile

from hf_zero3.ops import doctor
from hf_zero3.run import hostfile
from hf_zero3.run.launch_command import LaunchError, Target, resolve
from tests.conftest import ROOT, error_naming

REFUSED = "refused"
TABLE = [
    # (hostfile bytes, DeepSpeed's verdict: the hosts and slots, or the line our error must name, or REFUSED)
    (b"node-1 slots=8\nnode-2 slots=4\n", {"node-1": 8, "node-2": 4}),
    (b"# cluster\nnode-1 slots=8\n\n  node-2   slots=4  # spare\n", {"node-1": 8, "node-2": 4}),
    (b"   # indented comment\n\t\na slots=1", {"a": 1}),  # no final newline
    (b"a slots=4 max_slots=8\nb slots=2 max_slots=2\n", {"a": 4, "b": 2}),
    (b"a\tslots=2\n", {"a": 2}),
    (b"a slots=2\r\nb slots=3\r\n", {"a": 2, "b": 3}),
    (b"a slots=0\nb slots=2\n", {"a": 0, "b": 2}),  # that host gets no rank
    (b"a slots=02\n", {"a": 2}),
    (b"a slots=4x\n", {"a": 4}),  # DeepSpeed reads the leading digits
    (b"a#b slots=1\n", {"a#b": 1}),  # `#` starts a comment only at the start of a line
    ("a slots=\u0663\n".encode(), {"a": 3}),  # a Unicode digit: \d and int() both take it
    (b"localhost slots = 2\n", 1),
    (b"a slots=2\nlocalhost slots= 2\n", 2),
    (b"a slots=2\nlocalhost slots =2\n", 2),
    (b"a slot=2\n", 1),
    (b"a 4\n", 1),
    (b"a\n", 1),
    (b"slots=4\n", 1),
    (b"a slots=-1\n", 1),
    (b"a slots=two\n", 1),
    (b"a slots=2\n  b gpus=8\n", 2),
    (b"a slots=2\na slots=1\n", 2),  # duplicate
    (b"a slots=2 # ok\nb slots=1\nb slots=1\n", 3),
    (b"", REFUSED),
    (b"# only a comment\n\n", REFUSED),
    (b"\xff\xfe\x00garbage\n", REFUSED),  # not text
]


def verdict(read, path) -> dict | str:
    try:
        return dict(read(path))
    except ValueError:  # DeepSpeed: ValueError or UnicodeDecodeError; ours: HostfileError (a ValueError)
        return REFUSED


@pytest.mark.parametrize("content,expected", TABLE)
def test_verdict_and_slots_are_deepspeeds(tmp_path, content, expected):
    path = tmp_path / "hostfile"
    path.write_bytes(content)
    theirs = verdict(fetch_hostfile, path)
    assert theirs == (expected if isinstance(expected, dict) else REFUSED)  # the table says what DeepSpeed does
    assert verdict(hostfile.read_hostfile, path) == theirs
    if not isinstance(expected, dict):
        with pytest.raises(hostfile.HostfileError) as err:
            hostfile.read_hostfile(path)
        assert str(path) in str(err.value)
        if isinstance(expected, int):
            assert f"{path}:{expected}: " in str(err.value)


def test_errors_name_every_bad_line_and_its_fix():
    with pytest.raises(hostfile.HostfileError) as err:
        hostfile.parse_hostfile("a slots=2\nlocalhost slots = 2\nc\na slots=1\nd 4\n", "hf")
    message = str(err.value)
    error_naming(message, "hf:2: 'localhost slots = 2'", "write `localhost slots=2`")
    error_naming(message, "hf:3: 'c'", "`c slots=N`")
    error_naming(message, "hf:4: host a", "twice", "one line per host")
    error_naming(message, "hf:5: 'd 4'", "write `hostname slots=N`")
    with pytest.raises(hostfile.HostfileError) as err:
        hostfile.parse_hostfile("# empty\n", "hf")
    error_naming(str(err.value), "no hosts", "`hostname slots=N` per node")


def test_unreadable_hostfile_names_the_file(tmp_path):
    for path, reason in ((tmp_path / "missing", "No such file or directory"), (tmp_path, "Is a directory")):
        with pytest.raises(hostfile.HostfileError, match=f"cannot read hostfile {path}: {reason}"):
            hostfile.read_hostfile(path)


def test_zero_slots_is_a_doctor_warning(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("a slots=0\nb slots=2\n")
    ok, warn = doctor.check_hostfile(path, ssh=False)
    assert (ok.status, ok.data["hosts"]) == ("OK", {"a": 0, "b": 2})
    assert warn.status == "WARN" and "a: slots=0" in warn.detail and "slots=N" in warn.fix


@pytest.mark.parametrize("content,accepted", [("node1 slots=4 max_slots=8\nnode2 slots=4\n", True),
                                              ("node1 slots=4\nnode2 slots = 4\n", False)])
def test_launch_reads_the_hostfile_as_deepspeed_does(tmp_path, monkeypatch, content, accepted):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "hosts"
    path.write_text(content)
    env = {"HOSTFILE": str(path), "NUM_GPUS": "4", "NO_SSH": "1", "NODE_RANK": "0", "MASTER_ADDR": "node1",
           "DRY_RUN": "1"}
    if accepted:
        assert resolve(ROOT / "recipes" / "70b", [], env, Target(1, 8, "40GB")).world_size == 8
    else:
        with pytest.raises(LaunchError) as err:
            resolve(ROOT / "recipes" / "70b", [], env, Target(1, 8, "40GB"))
        error_naming(str(err.value), f"HOSTFILE: {path}:2: 'node2 slots = 4'", "write `node2 slots=4`")
