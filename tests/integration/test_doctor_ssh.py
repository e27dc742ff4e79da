"""`hf-zero3 doctor --hostfile` against a real SSH server: asyncssh on 127.0.0.1, OpenSSH's client.

The server accepts only public-key auth and runs each command with `/bin/sh -c` in an sshd-like environment
(no venv on PATH), so the remote fingerprint is really produced over SSH. The client is configured only
through PDSH_SSH_ARGS_APPEND and --ssh-port, the way DeepSpeed's pdsh runner reaches the nodes; keys and
known_hosts live in tmp_path (nothing in ~/.ssh is read or written)."""

from __future__ import annotations

import asyncio
import re
import shlex
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hf_zero3.ops import doctor
from tests.conftest import ROOT, explain, run

asyncssh = pytest.importorskip("asyncssh")
pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the OpenSSH client")]

HOST = "127.0.0.1"
SKIP_ALL_BUT_HOSTS = [arg for group in ("versions", "native", "gpus", "ops", "nvme", "allreduce")
                      for arg in ("--skip", group)]


@dataclass
class Sshd:
    port: int
    key: Path  # the client key the server authorizes
    other_key: Path  # a key it does not
    known_hosts: Path  # holds the server's host key
    env: dict  # what commands run with; a test may change it
    commands: list = field(default_factory=list)  # what the server ran

    def client_args(self, key: Path | None = None, known_hosts: Path | None = None) -> str:
        """PDSH_SSH_ARGS_APPEND: this key and known_hosts only, no ~/.ssh/config, no prompts."""
        return shlex.join(["-F", "/dev/null", "-i", str(key or self.key), "-o", "IdentitiesOnly=yes",
                           "-o", f"UserKnownHostsFile={known_hosts or self.known_hosts}",
                           "-o", "GlobalKnownHostsFile=/dev/null", "-o", "StrictHostKeyChecking=yes"])


def _write_key(path: Path):
    key = asyncssh.generate_private_key("ssh-ed25519")
    key.write_private_key(str(path))
    path.chmod(0o600)  # ssh ignores a private key others can read
    return key


@pytest.fixture
def sshd(tmp_path):
    """A real SSH server in a background event loop, closed with its connections at teardown."""
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key = _write_key(tmp_path / "id_ed25519")
    _write_key(tmp_path / "other_id_ed25519")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(Path.home()), "LANG": "C.UTF-8"}
    commands, connections = [], set()

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn):
            self.conn = conn
            connections.add(conn)

        def connection_lost(self, exc):
            connections.discard(self.conn)

    async def run_command(process):
        commands.append(process.command)
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", process.command or "true", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, env=dict(env))
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 120)
        finally:
            if proc.returncode is None:  # timed out or cancelled at teardown
                proc.kill()
                await proc.wait()
        process.stdout.write(out)
        process.stderr.write(err)
        process.exit(proc.returncode)

    async def start():
        return await asyncssh.listen(
            HOST, 0, server_factory=Server, server_host_keys=[host_key], process_factory=run_command,
            authorized_client_keys=asyncssh.import_authorized_keys(client_key.export_public_key().decode()),
            password_auth=False, kbdint_auth=False, encoding=None)

    async def shut_down():
        listener.close()
        for conn in list(connections):
            conn.close()
        await asyncio.wait_for(listener.wait_closed(), 10)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        listener = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        known_hosts = tmp_path / "known_hosts"
        known_hosts.write_text(f"[{HOST}]:{listener.get_port()} {host_key.export_public_key().decode()}")
        yield Sshd(listener.get_port(), tmp_path / "id_ed25519", tmp_path / "other_id_ed25519", known_hosts,
                   env, commands)
        asyncio.run_coroutine_threadsafe(shut_down(), loop).result(15)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        assert not thread.is_alive(), "the SSH server's event loop did not stop"
        loop.close()


@pytest.fixture
def hostfile(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(f"{HOST} slots=2\n")
    return path


def host_lines(out: str) -> dict[str, str]:
    pattern = r"^(OK|WARN|FAIL) +(\S+:\S+|hostfile) .*$"
    return {m.group(2): m.group(0) for m in re.finditer(pattern, out, re.MULTILINE)}


def test_doctor_over_real_ssh_finds_same_code_and_versions(sshd, hostfile):
    """The console script, as `make sync` runs it: exit 0, all host lines OK, the fingerprint ran remotely."""
    proc = run(["hf-zero3", "doctor", "--hostfile", hostfile, "--ssh-port", sshd.port, *SKIP_ALL_BUT_HOSTS],
               timeout=120, PDSH_SSH_ARGS_APPEND=sshd.client_args())
    assert proc.returncode == 0, explain(proc)
    lines = host_lines(proc.stdout)
    assert set(lines) == {"hostfile", f"ssh:{HOST}", f"code:{HOST}", f"versions:{HOST}"}, explain(proc)
    assert all(line.startswith("OK ") for line in lines.values()), explain(proc)
    assert "same tracked files (sha256 " in lines[f"code:{HOST}"]
    assert proc.stdout.strip().splitlines()[-1] == "doctor: 4 ok, 0 warning(s), 0 failure(s)"
    assert sshd.commands[0] == "true" and sshd.commands[1].endswith(" -m hf_zero3.ops.doctor --fingerprint")
    assert sshd.commands[1].startswith(f"cd {ROOT} && ")


def test_unknown_host_key_fails_with_keyscan_fix_that_works(sshd, hostfile, tmp_path, monkeypatch):
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", sshd.client_args(known_hosts=empty))
    results = doctor.check_hostfile(hostfile, port=sshd.port)
    assert [r.status for r in results] == ["OK", "FAIL"], [r.line() for r in results]
    failed = results[1]
    assert failed.name == f"ssh:{HOST}" and failed.detail.endswith("Host key verification failed.")
    assert f"`ssh-keyscan -p {sshd.port} {HOST} >> ~/.ssh/known_hosts`" in failed.fix
    assert sshd.commands == []  # refused before any command ran
    # The fix, into this test's known_hosts instead of ~/.ssh's: then SSH works.
    scan = subprocess.run(["ssh-keyscan", "-p", str(sshd.port), HOST], capture_output=True, text=True,
                          timeout=30, check=False)
    assert scan.returncode == 0 and scan.stdout.strip(), scan.stderr
    empty.write_text(scan.stdout)
    proc = doctor._ssh(HOST, "true", timeout=30, port=sshd.port)
    assert proc.returncode == 0, proc.stderr


def test_key_not_authorized_fails_with_ssh_copy_id_fix(sshd, hostfile, monkeypatch):
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", sshd.client_args(key=sshd.other_key))
    results = doctor.check_hostfile(hostfile, port=sshd.port)
    assert [r.status for r in results] == ["OK", "FAIL"], [r.line() for r in results]
    assert "Permission denied (publickey)" in results[1].detail
    assert f"`ssh-copy-id -p {sshd.port} {HOST}`" in results[1].fix
    assert sshd.commands == []


def test_remote_without_git_checkout_is_a_code_difference(sshd, hostfile, monkeypatch):
    """A host whose copy lost .git (rsync without it) hashes its .py files instead: the doctor says sync."""
    sshd.env["GIT_DIR"] = "/nonexistent/.git"  # git finds no repository for the checkout there
    monkeypatch.setenv("PDSH_SSH_ARGS_APPEND", sshd.client_args())
    results = {r.name: r for r in doctor.check_hostfile(hostfile, port=sshd.port)}
    assert results[f"ssh:{HOST}"].status == "OK"
    assert results[f"versions:{HOST}"].status == "OK"
    code = results[f"code:{HOST}"]
    assert code.status == "FAIL" and "tracked files differ" in code.detail, code.line()
    assert f"make sync HOSTFILE=<hostfile> SSH_PORT={sshd.port}` in {ROOT}" in code.fix
