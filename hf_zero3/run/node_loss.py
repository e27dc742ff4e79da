"""A node lost: how the ranks left stop, how long the launcher waits for them, and which node it names.

Three waits stand between a lost node and a job that hangs until the scheduler's time limit, and each gets a bound:
- A collective waits `ddp_timeout` for a rank that does not answer (`hf_zero3.job.distributed` passes it to the
  process group it starts). A rank whose peer's process died sees its connection closed at once; one whose peer's
  network is cut sees nothing until then. It stops with one line naming what it lost (`peer_lost`), exit 69.
- pdsh's ssh session to a node whose network is cut notices nothing either, ever (the node cannot send a reset):
  the launcher has ssh probe every node and give up on one silent for NODE_TIMEOUT seconds (`ssh_keepalive`).
- Once a node failed, the ranks elsewhere may sit in a collective until `ddp_timeout` (30 minutes by default):
  the launcher gives them NODE_TIMEOUT seconds more, then stops the job the way DeepSpeed's runner does on
  SIGINT or SIGTERM, whichever is not a preemption signal (pkill of its per-node launchers on every node, over pdsh;
  they end their ranks).

pdsh reports each node's end (`pdsh@HOST: NODE: ssh exited with exit code N`); `NodeWatch` reads those lines, names
the node that failed by itself (not one whose ranks only lost a peer) and what its code means.
"""

from __future__ import annotations

import math
import re
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from hf_zero3.job.preemption import PREEMPTED_EXIT

PEER_LOST_EXIT = 69
"""The exit code of a rank that stopped because a collective lost a peer (sysexits' EX_UNAVAILABLE): another
rank's process, node or network failed, not this one."""

USAGE_EXIT = 2
"""A rank's exit on bad input (`hf_zero3.run.train`): every rank stops by itself, rank 0 saying why."""

DEFAULT_NODE_TIMEOUT = 60
"""NODE_TIMEOUT: seconds of silence after which ssh gives a node up, and seconds the other nodes' ranks get to stop
by themselves after a node failed, before the launcher stops them."""

KEEPALIVE_PROBES = 3
"""ssh's ServerAliveCountMax: unanswered probes, NODE_TIMEOUT / 3 seconds apart, before it gives a node up."""

_PDSH_EXIT = re.compile(r"^pdsh@[^:\s]+: (?P<node>[^:\s]+): ssh exited with exit code (?P<code>\d+)\s*$")
_PEER_ADDRESS = re.compile(r"\[(?P<address>[^\]/\s]+)\]:\d+")
"""A peer's `[address]:port` in gloo's messages (not its `[path/pair.cc:537]`)."""
_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
"""The TCPStore's words for ranks that never came: `Timed out after 6 seconds waiting for clients. 1/2 clients
joined.`"""
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
              "Socket Timeout", "Timed out", "timed out", "NCCL communicator was aborted",
              "Watchdog caught collective operation timeout")
"""How gloo, the TCPStore and NCCL report a peer that stopped answering."""


def ssh_keepalive(env: Mapping[str, str], node_timeout: int) -> dict[str, str]:
    """`env` with ssh's keepalive in PDSH_SSH_ARGS_APPEND (what DeepSpeed's pdsh runner, and pdsh, pass to ssh):
    a probe every NODE_TIMEOUT / 3 seconds, the node given up after 3 unanswered. Unchanged when node_timeout is 0
    or PDSH_SSH_ARGS_APPEND already sets ServerAlive* (the user's choice)."""
    env = dict(env)
    given = env.get("PDSH_SSH_ARGS_APPEND", "")
    if node_timeout <= 0 or "serveralive" in given.lower():
        return env
    interval = max(1, math.ceil(node_timeout / KEEPALIVE_PROBES))
    env["PDSH_SSH_ARGS_APPEND"] = (f"{given} -o ServerAliveInterval={interval} "
                                   f"-o ServerAliveCountMax={KEEPALIVE_PROBES}").strip()
    return env


def peer_lost(error: BaseException) -> str | None:
    """What a failed collective says about the peer it lost (its address where the message names one), or None
    when `error` is not a lost peer."""
    text = str(error)
    if not isinstance(error, RuntimeError) or not any(marker in text for marker in _LOST_PEER):
        return None
    joined = _JOINED.search(text)
    if joined:
        return (f"the ranks that never joined: {joined.group(1)} of {joined.group(2)} reached MASTER_ADDR:MASTER_PORT "
                "within ddp_timeout")
    address = _PEER_ADDRESS.search(text)
    if address:
        return f"the rank at {address.group('address')} ({next(m for m in _LOST_PEER if m in text).lower()})"
    if "imed out" in text or "timeout" in text.lower():
        return "a rank that did not answer within ddp_timeout"
    return f"a peer ({text.splitlines()[0][:200]})"


def explain_exit(code: int) -> str:
    """What a node's exit code (its DeepSpeed launcher's, through ssh and pdsh) says happened there."""
    if code == 255:
        return "ssh lost it (no answer for NODE_TIMEOUT seconds: its network or the node itself is down)"
    if code == PEER_LOST_EXIT:
        return "its ranks lost a peer"
    if code == 1:
        return "a rank stopped on an error (its traceback is above)"
    if code == USAGE_EXIT:
        return "a rank stopped on a usage error (the message above)"
    if 129 <= code < 255:  # DeepSpeed's per-node launcher exits -N for a rank killed by signal N: 256 - N
        number = 256 - code if code > 192 else code - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        why = {"SIGKILL": " (kill -9, or the out-of-memory killer: `dmesg` there says)",
               "SIGABRT": " (an abort: on GPUs, NCCL's watchdog ends a rank whose collective waited past "
                          "ddp_timeout)"}.get(name, "")
        return f"a rank there was killed by {name}{why}"
    return f"exit {code}"


@dataclass
class NodeWatch:
    """pdsh's lines as they come: which node ended with what, when the launcher should stop the rest, and what to
    tell the user at the end.

    Args:
        grace_s: seconds the other nodes get after the first failure before `stop_due` says stop (NODE_TIMEOUT).
    """

    grace_s: float
    clock: Callable[[], float] = time.monotonic
    ends: list[tuple[str, int]] = field(default_factory=list)
    """(node, exit code) in the order pdsh reported them, the first report of each node only."""
    stopped_nodes: set[str] = field(default_factory=set)
    """Nodes that ended after the launcher stopped the job."""
    _first_failure_at: float | None = None
    stopped: bool = False

    def feed(self, line: str) -> None:
        match = _PDSH_EXIT.match(line)
        if match is None or match.group("node") in dict(self.ends):  # a later line: the stop's own pkill
            return
        code = int(match.group("code"))
        self.ends.append((match.group("node"), code))
        if self.stopped:
            self.stopped_nodes.add(match.group("node"))
        # a usage error stops every rank by itself (the others wait a few seconds for rank 0's message first)
        if code not in (0, PREEMPTED_EXIT, USAGE_EXIT) and self._first_failure_at is None:
            self._first_failure_at = self.clock()

    def failures(self) -> list[tuple[str, int]]:
        return [(node, code) for node, code in self.ends if code not in (0, PREEMPTED_EXIT)]

    def culprit(self) -> tuple[str, int] | None:
        """The node that failed by itself: the first failure that is neither a lost peer nor a usage error (else the
        first lost peer, else the first usage error)."""
        failures = self.failures()
        own = [f for f in failures if f[1] not in (PEER_LOST_EXIT, USAGE_EXIT)]
        return (own or [f for f in failures if f[1] == PEER_LOST_EXIT] or failures or [None])[0]

    def stop_due(self) -> bool:
        """A node failed `grace_s` ago and the launcher has not stopped the rest yet."""
        return (not self.stopped and self._first_failure_at is not None
                and self.clock() - self._first_failure_at >= self.grace_s)

    def summary(self, hosts: Sequence[str]) -> str | None:
        """The line naming the node that failed, the others' ends, and how to go on; None when none failed (or a
        usage error stopped the ranks: their message names the fix)."""
        culprit = self.culprit()
        if culprit is None or culprit[1] == USAGE_EXIT:  # no node failed, or the ranks' usage error says it all
            return None
        node, code = culprit
        ended = dict(self.ends)
        others = [f"{h} stopped by the launcher" if h in self.stopped_nodes or h not in ended
                  else f"{h} exit {ended[h]}: {explain_exit(ended[h])}" for h in hosts if h != node]
        return (f"hf_zero3.run.launch: node {node} failed: exit {code}, {explain_exit(code)}."
                + (f" The other nodes: {'; '.join(others)}." if others else "")
                + " Restart or replace that node (the same number of ranks), then run the same command with "
                "--resume_from_checkpoint auto: it resumes from the newest checkpoint complete on every node")
