"""A node lost, as the launcher reads it: pdsh's lines, the node named, when to stop the rest; what a rank says
when a collective loses a peer; ssh's keepalive. The real thing runs in tests/integration/test_multinode.py."""

from __future__ import annotations

import pytest

from hf_zero3.run.launch_command import LaunchError, Target, resolve
from hf_zero3.run.node_loss import (
    PEER_LOST_EXIT,
    NodeWatch,
    explain_exit,
    peer_lost,
    ssh_keepalive,
)
from tests.conftest import ROOT, error_naming

GLOO_RESET = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [10.1.2.3]:31972: Connection "
              "reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")
GLOO_CLOSED = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.1.2.3]:59075. This is typically"
GLOO_TIMEOUT = "[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation to complete"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_node_that_failed_by_itself_is_named_whichever_pdsh_reports_first():
    killed = "pdsh@head: b: ssh exited with exit code 247"
    lost = f"pdsh@head: a: ssh exited with exit code {PEER_LOST_EXIT}"
    for lines in ([killed, lost], [lost, killed]):
        watch = NodeWatch(grace_s=60)
        for line in ["a: some output of a rank", *lines]:
            watch.feed(line + "\n")
        assert watch.culprit() == ("b", 247)
        summary = watch.summary(["a", "b"])
        error_naming(summary, "node b failed", "exit 247", "SIGKILL")
        assert f"a exit {PEER_LOST_EXIT}: its ranks lost a peer" in summary
        assert "--resume_from_checkpoint auto" in summary


def test_the_rest_are_stopped_only_grace_seconds_after_a_failure_and_only_once():
    clock = Clock()
    watch = NodeWatch(grace_s=60, clock=clock)
    watch.feed("pdsh@head: a: ssh exited with exit code 0")  # a node done is no failure
    watch.feed("pdsh@head: c: ssh exited with exit code 75")  # nor a preempted one
    watch.feed("pdsh@head: e: ssh exited with exit code 2")  # a usage error: every rank stops by itself
    clock.now = 500
    assert not watch.stop_due() and watch.summary(["a", "c", "e"]) is None
    watch.feed("pdsh@head: b: ssh exited with exit code 255")
    clock.now = 559
    assert not watch.stop_due()
    clock.now = 560
    assert watch.stop_due()
    watch.stopped = True
    assert not watch.stop_due()
    watch.feed("pdsh@head: a: ssh exited with exit code 1")  # the stop's own pkill on a node already done: ignored
    watch.feed("pdsh@head: d: ssh exited with exit code 1")  # a node that ended after the stop
    summary = watch.summary(["a", "b", "c", "d", "e", "f"])  # f: never reported
    assert "node b failed: exit 255, ssh lost it" in summary
    assert "a exit 0: exit 0" in summary and "d stopped by the launcher" in summary
    assert "e exit 2: a rank stopped on a usage error" in summary and "f stopped by the launcher" in summary


@pytest.mark.parametrize("code, says", [
    (247, "killed by SIGKILL (kill -9, or the out-of-memory killer"),
    (250, "killed by SIGABRT (an abort: on GPUs, NCCL's watchdog"),
    (137, "killed by SIGKILL"),
    (255, "ssh lost it"),
    (PEER_LOST_EXIT, "lost a peer"),
    (1, "stopped on an error"),
    (2, "usage error"),
])
def test_an_exit_code_says_what_happened_on_the_node(code, says):
    assert says in explain_exit(code)


def test_a_rank_names_the_peer_it_lost_and_leaves_other_errors_alone():
    assert peer_lost(RuntimeError(GLOO_RESET)) == "the rank at 10.1.2.3 (connection reset by peer)"
    assert peer_lost(RuntimeError(GLOO_CLOSED)) == "the rank at 10.1.2.3 (connection closed by peer)"
    assert peer_lost(RuntimeError(GLOO_TIMEOUT)) == "a rank that did not answer within ddp_timeout"
    never_joined = peer_lost(RuntimeError("Timed out after 6 seconds waiting for clients. 1/2 clients joined."))
    error_naming(never_joined, "never joined", "1 of 2", "MASTER_ADDR:MASTER_PORT", "ddp_timeout")
    assert peer_lost(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None
    assert peer_lost(ValueError(GLOO_RESET)) is None


def test_ssh_probes_every_node_unless_told_otherwise():
    assert ssh_keepalive({}, 60)["PDSH_SSH_ARGS_APPEND"] == "-o ServerAliveInterval=20 -o ServerAliveCountMax=3"
    assert ssh_keepalive({"PDSH_SSH_ARGS_APPEND": "-p 2222"}, 5)["PDSH_SSH_ARGS_APPEND"] == (
        "-p 2222 -o ServerAliveInterval=2 -o ServerAliveCountMax=3")
    mine = {"PDSH_SSH_ARGS_APPEND": "-o ServerAliveInterval=30"}
    assert ssh_keepalive(mine, 60) == mine
    assert "PDSH_SSH_ARGS_APPEND" not in ssh_keepalive({}, 0)


def test_node_timeout_is_checked_and_the_watched_hosts_are_those_launched(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    hosts = tmp_path / "hosts"
    hosts.write_text("a slots=2\nb slots=2\nc slots=2\n")
    (tmp_path / "pdsh").write_text("#!/bin/sh\n")
    (tmp_path / "pdsh").chmod(0o755)
    env = {"HOSTFILE": str(hosts), "NUM_NODES": "2", "NUM_GPUS": "2", "PATH": str(tmp_path)}
    launch = resolve(ROOT / "recipes/tiny", [], env, Target())
    assert launch.remote_hosts == ("a", "b") and launch.node_timeout == 60
    assert resolve(ROOT / "recipes/tiny", [], {**env, "NODE_TIMEOUT": "0"}, Target()).node_timeout == 0
    excluded = resolve(ROOT / "recipes/tiny", [], {"HOSTFILE": str(hosts), "EXCLUDE": "b", "PATH": str(tmp_path)},
                       Target())
    assert excluded.remote_hosts == ("a", "c")
    with pytest.raises(LaunchError, match="NODE_TIMEOUT=soon is not a whole number"):
        resolve(ROOT / "recipes/tiny", [], {**env, "NODE_TIMEOUT": "soon"}, Target())
