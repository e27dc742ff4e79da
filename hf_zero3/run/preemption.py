"""Preemption: the signals a scheduler sends before it kills a job, the exit code of a run stopped by one, and the
launcher's part: passing those signals to the ranks, past DeepSpeed's launcher.

The ranks' part (finish the step, save a checkpoint, stop) is `hf_zero3.callbacks.preemption`.

Why the launcher takes a part: DeepSpeed's launcher does not pass a scheduler's warning on. `deepspeed` on one node
(`deepspeed.launcher.runner`) has no signal handler at all: SIGTERM or SIGUSR1 ends it and leaves the ranks running,
unsignalled. The per-node `deepspeed.launcher.launch` answers SIGTERM by sending SIGTERM to every rank, SIGKILL 30 s
later, and exit 1 (not the ranks' code); SIGUSR1 simply ends it. So `hf-zero3 launch` starts DeepSpeed's launcher
with the preemption signals ignored (a disposition every process it starts inherits, until a rank installs its
handler), stays its parent, and sends each preemption signal it receives to the ranks themselves: the processes
DeepSpeed's per-node launcher started, found under this one (`ranks_below`). A signal sent to every process of the
job (SLURM's `--signal`, `kill -USR1 -- -PGID`) reaches the ranks directly and leaves the launchers standing.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

DEFAULT_SIGNALS = "SIGTERM,SIGUSR1"
"""SIGTERM: what SLURM, Kubernetes and the clouds' spot VMs send first; SIGUSR1: SLURM's usual `--signal` warning."""

PREEMPTED_EXIT = 75
"""The exit code of a run stopped by a preemption signal after it saved a checkpoint: sysexits' EX_TEMPFAIL, "try
again". The same command with `--resume_from_checkpoint auto` continues. DeepSpeed's launcher and pdsh pass it on."""

UNCATCHABLE = ("SIGKILL", "SIGSTOP")
STOP_WAIT_S = 90
"""After the SIGTERM that stops a job whose node failed, how long DeepSpeed's runner gets to end it (its pkill over
pdsh waits out ssh's 10 s connect timeout for a node that is gone; the per-node launchers give their ranks 30 s)
before it is killed."""
PER_NODE_LAUNCHER = "deepspeed.launcher.launch"
"""The module in the command line of DeepSpeed's per-node launcher: its children are the ranks."""


def parse_signals(text: str | None) -> list[signal.Signals]:
    """`preemption_signals`: comma-separated names (SIGTERM, USR1, ...); empty or `none` for none. A ValueError names
    the bad name and the fix."""
    names = [] if text is None else [n.strip().upper() for n in str(text).split(",") if n.strip()]
    if names in ([], ["NONE"]):
        return []
    found = []
    for name in names:
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full in UNCATCHABLE:
            raise ValueError(f"preemption_signals: {full} cannot be caught by any process: list signals a scheduler "
                             f"sends ahead of the kill, e.g. {DEFAULT_SIGNALS}")
        if not hasattr(signal.Signals, full) or full.startswith("SIG_"):
            raise ValueError(f"preemption_signals: {name!r} is not a signal name: use names like {DEFAULT_SIGNALS} "
                             "(comma-separated), or none")
        if signal.Signals[full] not in found:
            found.append(signal.Signals[full])
    return found


def signals_of_argv(train_argv: Sequence[str]) -> list[signal.Signals]:
    """The `preemption_signals` of a training command line (its YAML, then a `--preemption_signals` override), for
    the launcher, which must not wait the seconds `hf_zero3.run.train.load_arguments` takes to import the Trainer. A
    YAML or a value that does not parse counts as the default: the ranks report it before anything starts."""
    import yaml

    value: object = DEFAULT_SIGNALS
    if train_argv and not train_argv[0].startswith("--"):
        try:
            loaded = yaml.safe_load(open(train_argv[0]).read()) or {}
            value = loaded.get("preemption_signals", value) if isinstance(loaded, dict) else value
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            pass
    for i, arg in enumerate(train_argv):
        if arg.startswith(("--preemption_signals=", "--preemption-signals=")):
            value = arg.split("=", 1)[1]
        elif arg in ("--preemption_signals", "--preemption-signals") and i + 1 < len(train_argv):
            value = train_argv[i + 1]
    try:
        return parse_signals(None if value is None else str(value))
    except ValueError:
        return parse_signals(DEFAULT_SIGNALS)


def ranks_below(pid: int) -> list:
    """The processes DeepSpeed's per-node launchers under `pid` started (psutil.Process objects): this node's ranks."""
    import psutil

    ranks = []
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for process in below:
        try:
            if any(PER_NODE_LAUNCHER in part for part in process.cmdline()):
                ranks += process.children()
        except psutil.Error:  # it ended meanwhile
            continue
    return ranks


def remote_command(sig: signal.Signals, master_port: str) -> str:
    """What pdsh runs on each node to pass `sig` to this job's ranks there: the children of DeepSpeed's per-node
    launcher of this master port (a node's launcher, started over SSH, does not ignore the signal: it must not
    get it)."""
    pattern = rf"^[^ ]*python[^ ]* -u -m deepspeed[.]launcher[.]launch .*--master_port={master_port}( |$)"
    return f"pids=$(pgrep -d, -f '{pattern}') && pkill -{sig.name[3:]} -P \"$pids\""


def _tell_nodes(command: Sequence[str], env: Mapping[str, str], hosts: Sequence[str], sig: signal.Signals) -> None:
    """pdsh, as DeepSpeed's runner calls it (its --ssh_port, PDSH_SSH_ARGS_APPEND), runs `remote_command`."""
    port = next((a.split("=", 1)[1] for a in command if a.startswith("--master_port=")), None)
    ssh_port = next((a.split("=", 1)[1] for a in command if a.startswith("--ssh_port=")), None)
    if port is None:
        return
    env = {**env, "PDSH_RCMD_TYPE": "ssh"}
    if ssh_port:
        env["PDSH_SSH_ARGS_APPEND"] = f"{env.get('PDSH_SSH_ARGS_APPEND', '')} -p {ssh_port}".strip()
    subprocess.Popen(["pdsh", "-S", "-w", ",".join(hosts), remote_command(sig, port)], env=env,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _read_stderr(child: subprocess.Popen, watch) -> threading.Thread:
    """Pass the child's standard error on, line by line, each line also to `watch`."""
    def copy():
        for line in child.stderr:
            sys.stderr.write(line)
            sys.stderr.flush()
            watch.feed(line)

    reader = threading.Thread(target=copy, name="launcher-stderr", daemon=True)
    reader.start()
    return reader


def _exit_status(returncode: int) -> int:
    """A child's status as a shell reports it: 128 + N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def run_forwarding(command: Sequence[str], env: Mapping[str, str], signals: Sequence[signal.Signals],
                   remote_hosts: Sequence[str] = (), poll_s: float = 0.5, watch=None) -> int:
    """Run DeepSpeed's launcher `command` with `signals` ignored in it, pass each of them on to the ranks, and
    return its exit status. Other signals (SIGINT, SIGHUP, a SIGTERM that is not listed) go to the launcher, which
    handles them as it would as the first process.

    A preemption signal is sent again to ranks that start after it (still loading, they ignore it until their
    handler is in place; a rank sees a repeated signal as one). With `remote_hosts` (DeepSpeed's pdsh runner starts
    the ranks there over SSH) it goes to each of them through pdsh (`remote_command`), once.

    `watch` (a `hf_zero3.run.node_loss.NodeWatch`) reads the launcher's standard error, which is passed on line by line;
    when it says a node failed long enough ago, the launcher gets SIGTERM: DeepSpeed's pdsh runner then ends the
    ranks on every node. Its summary is printed at the end."""
    import psutil

    signals = list(signals)

    def ignore_in_child():
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)

    child = subprocess.Popen(list(command), env=dict(env), preexec_fn=ignore_in_child,
                             **({"stderr": subprocess.PIPE, "text": True, "errors": "replace", "bufsize": 1}
                                if watch is not None else {}))
    reader = _read_stderr(child, watch) if watch is not None else None
    stop_sent = 0.0
    pending: list[signal.Signals] = []
    told: set[tuple[int, int]] = set()

    def forward(signum, frame):
        if signum in signals:
            pending.append(signal.Signals(signum))
        elif child.poll() is None:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in {*signals, signal.SIGINT, signal.SIGHUP, signal.SIGTERM}}
    told_nodes: set[signal.Signals] = set()
    try:
        while True:
            for sig in dict.fromkeys(pending):
                if remote_hosts and sig not in told_nodes:
                    told_nodes.add(sig)
                    _tell_nodes(command, env, remote_hosts, sig)
                for rank in ranks_below(child.pid):
                    if (rank.pid, sig) not in told:
                        told.add((rank.pid, sig))
                        with contextlib.suppress(psutil.Error, OSError):  # it ended meanwhile
                            rank.send_signal(sig)
            if watch is not None and watch.stop_due():
                watch.stopped, stop_sent = True, time.monotonic()
                print(f"hf_zero3.run.launch: a node failed {watch.grace_s:.0f} s ago and the others have not stopped: "
                      "stopping the job on every node", file=sys.stderr, flush=True)
                child.send_signal(signal.SIGTERM)  # DeepSpeed's pdsh runner: pkill on every node, then exit 1
            elif stop_sent and time.monotonic() - stop_sent > STOP_WAIT_S:
                child.kill()
            try:
                status = _exit_status(child.wait(timeout=poll_s))
            except subprocess.TimeoutExpired:
                continue
            if reader is not None:
                reader.join(timeout=10)
                if summary := watch.summary(remote_hosts):
                    print(summary, file=sys.stderr, flush=True)
            return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:  # only on an error of ours: never leave DeepSpeed's launcher behind
            child.terminate()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()

