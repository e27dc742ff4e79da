"""Preemption: the signals a scheduler sends before it kills a job, the exit code of a run stopped by one, and the
launcher's part: passing those signals to the ranks, past DeepSpeed's launcher.

The ranks' part (finish the step, save a checkpoint, stop) is `hf_zero3.callbacks.preemption`.

Why the launcher takes a part: DeepSpeed's launcher does not pass a scheduler's warning on. `deepspeed` on one node
(`deepspeed.launcher.runner`) has no signal handler at all: SIGTERM or SIGUSR1 ends it and leaves the ranks running,
unsignalled. The per-node `deepspeed.launcher.launch` answers SIGTERM by sending SIGTERM to every rank, SIGKILL 30 s
later, and exit 1 (not the ranks' code); SIGUSR1 simply ends it; the pdsh runner answers SIGTERM with a pkill on
every node and exit 1. So `hf-zero3 launch` starts DeepSpeed's launcher with the preemption signals blocked (a mask
every process it starts inherits, DeepSpeed's launchers and the ranks included: their handlers never run, and a
signal sent early stays pending until a rank installs its handler and unblocks it: none is lost), stays its parent,
and sends each preemption signal it receives to the ranks themselves: the processes DeepSpeed's per-node launcher
started, found under this one (`ranks_below`), and on other nodes through pdsh (`remote_command`). A signal sent to
every process of the job (SLURM, `kill -TERM -- -PGID`) reaches this launcher, which passes it on, and the ranks,
and leaves DeepSpeed's launchers standing: the exit code is the ranks' 75.
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


REMOTE_HOLD_S = 600
"""How long `remote_command` holds a signal for a node's ranks to start and install their handler."""


def remote_command(sig: signal.Signals, master_port: str) -> str:
    """What pdsh runs on each node to pass `sig` to this job's ranks there: the children of DeepSpeed's per-node
    launcher of this master port (a node's launcher, started over SSH, does not block the signal: it must not get it).
    The signal is held until every rank there catches it (its SigCgt mask in /proc): one sent earlier would be lost,
    or end a rank that has no handler yet. It gives up when the node's launcher, once seen, has ended."""
    pattern = rf"^[^ ]*python[^ ]* -u -m deepspeed[.]launcher[.]launch .*--master_port={master_port}( |$)"
    caught = (f'm=$(sed -n "s/^SigCgt:[[:space:]]*//p" /proc/$p/status 2>/dev/null); [ -n "$m" ] && '
              f'[ $(( 0x$m >> {sig.value - 1} & 1 )) = 1 ] || ready=0')
    return (f"n=0; seen=0; while [ $n -lt {REMOTE_HOLD_S * 2} ]; do "
            f"if pids=$(pgrep -d, -f '{pattern}'); then seen=1; elif [ $seen = 1 ]; then exit 0; fi; "
            f"[ $seen = 1 ] && ranks=$(pgrep -P \"$pids\") && ready=1 && "
            f"for p in $ranks; do {caught}; done && [ $ready = 1 ] && exec kill -{sig.name[3:]} $ranks; "
            "sleep 0.5; n=$((n+1)); done")


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


def _block_in_child(signals: Sequence[signal.Signals]):
    """What the launcher's child runs before it starts: `signals` blocked (a mask every process it starts inherits,
    DeepSpeed's per-node launcher and the ranks included) and ignored. Blocked, a signal stays pending, so none is
    lost: DeepSpeed's launchers, which install their own SIGTERM handler (kill the ranks 30 s later, exit 1), never
    run it; a rank takes it once its handler is in place (`hf_zero3.callbacks.preemption` unblocks it then)."""
    def block_and_ignore():
        signal.pthread_sigmask(signal.SIG_BLOCK, signals)
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)

    return block_and_ignore


def _stop_signal(signals: Sequence[signal.Signals]) -> signal.Signals:
    """The signal that makes DeepSpeed's pdsh runner stop the job on every node: SIGINT or SIGTERM (it handles both
    alike), whichever is not blocked in it as a preemption signal."""
    return next((s for s in (signal.SIGINT, signal.SIGTERM) if s not in signals), signal.SIGKILL)


class _Forwarder:
    """The preemption signals the launcher received, passed on to each rank (local: once per rank, held by the
    kernel until the rank takes it; remote: through pdsh, once per signal)."""

    def __init__(self, child: subprocess.Popen, command, env, signals, remote_hosts):
        self.child, self.command, self.env = child, command, env
        self.signals, self.remote_hosts = list(signals), remote_hosts
        self.pending: list[signal.Signals] = []
        self.told: set[tuple[int, int]] = set()
        self.told_nodes: set[signal.Signals] = set()

    def receive(self, signum, frame) -> None:
        if signum in self.signals:
            self.pending.append(signal.Signals(signum))
        elif self.child.poll() is None:
            self.child.send_signal(signum)

    def pass_on(self) -> None:
        import psutil

        for sig in dict.fromkeys(self.pending):
            if self.remote_hosts and sig not in self.told_nodes:
                self.told_nodes.add(sig)
                _tell_nodes(self.command, self.env, self.remote_hosts, sig)
            for rank in ranks_below(self.child.pid):
                if (rank.pid, sig) not in self.told:
                    self.told.add((rank.pid, sig))
                    with contextlib.suppress(psutil.Error, OSError):  # it ended meanwhile
                        rank.send_signal(sig)

    def status(self, returncode: int) -> int:
        """The launcher's exit status: a run that got a preemption signal and ended well (the signal came as it
        finished: its final model is saved) exits 75 too, as any run a scheduler stopped; the same command then says
        it is finished."""
        status = _exit_status(returncode)
        if status == 0 and self.pending:
            print(f"hf_zero3.run.launch: {self.pending[0].name} received as the run finished: exit {PREEMPTED_EXIT} "
                  "(the same command with --resume_from_checkpoint auto says it is finished)", file=sys.stderr,
                  flush=True)
            return PREEMPTED_EXIT
        return status


def run_forwarding(command: Sequence[str], env: Mapping[str, str], signals: Sequence[signal.Signals],
                   remote_hosts: Sequence[str] = (), poll_s: float = 0.5, watch=None) -> int:
    """Run DeepSpeed's launcher `command` with `signals` blocked in it (`_block_in_child`), pass each of them on to
    the ranks (`_Forwarder`), and return its exit status: 75 whenever one came and the ranks saved. Other signals
    (SIGINT, SIGHUP, a SIGTERM that is not listed) go to the launcher, which handles them as it would as the first
    process. With `remote_hosts` (DeepSpeed's pdsh runner starts the ranks there over SSH) a signal goes to each of
    them through pdsh (`remote_command`), once.

    `watch` (a `hf_zero3.run.node_loss.NodeWatch`) reads the launcher's standard error, which is passed on line by line;
    when it says a node failed long enough ago, the launcher gets `_stop_signal`: DeepSpeed's pdsh runner then ends
    the ranks on every node. Its summary is printed at the end."""
    signals = list(signals)
    child = subprocess.Popen(list(command), env=dict(env), preexec_fn=_block_in_child(signals),
                             **({"stderr": subprocess.PIPE, "text": True, "errors": "replace", "bufsize": 1}
                                if watch is not None else {}))
    reader = _read_stderr(child, watch) if watch is not None else None
    forwarder = _Forwarder(child, command, env, signals, remote_hosts)
    stop_sent = 0.0
    previous = {sig: signal.signal(sig, forwarder.receive)
                for sig in {*signals, signal.SIGINT, signal.SIGHUP, signal.SIGTERM}}
    try:
        while True:
            forwarder.pass_on()
            if watch is not None and watch.stop_due():
                watch.stopped, stop_sent = True, time.monotonic()
                print(f"hf_zero3.run.launch: a node failed {watch.grace_s:.0f} s ago and the others have not stopped: "
                      "stopping the job on every node", file=sys.stderr, flush=True)
                child.send_signal(_stop_signal(signals))  # DeepSpeed's pdsh runner: pkill on every node, exit 1
            elif stop_sent and time.monotonic() - stop_sent > STOP_WAIT_S:
                child.kill()
            try:
                returncode = child.wait(timeout=poll_s)
            except subprocess.TimeoutExpired:
                continue
            if reader is not None:
                reader.join(timeout=10)
                if summary := watch.summary(remote_hosts):
                    print(summary, file=sys.stderr, flush=True)
            return forwarder.status(returncode)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:  # only on an error of ours: never leave DeepSpeed's launcher behind
            child.send_signal(_stop_signal(signals))
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
