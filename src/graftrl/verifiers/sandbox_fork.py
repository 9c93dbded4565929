"""The code verifier's fork server ("zygote", ``reward.code.fork_server``): the first process of
a long-lived ``serve`` or ``judge`` sandbox, graftrl's own code that never runs a program itself.

Standard library only, like ``sandbox_entry``, which executes this file's source (passed as an
argument) and hands it its own module (``entry``: ``confine``, ``serve``, ``judge``, ``Channel``).
The verifier (``graftrl.verifiers.zygote``) sends one request per program over a unix socket, a
length-prefixed JSON message with the program's pipes attached (``send_message``). Per request the
zygote forks a child that keeps only those pipes, takes a fresh IPC namespace, applies ``confine``
(limits, then the slot's user, no capabilities) and runs the role; then it waits for the
verifier's stop or the request's deadline, kills the child, kills every process of the slot's user
in this sandbox (``sweep``), empties /tmp, and confirms. A request of the other role, or a clean-up
it cannot confirm, ends the zygote (and its sandbox with it).
"""

from __future__ import annotations

import contextlib
import json
import os
import select

MAX_REQUEST = 64 << 20
"""Largest message on the socket (bytes)."""

SWEEPER_UID = 1_699_999_999
"""Real and saved user id of the zygote's sweeper (its effective id is the slot's): it may signal
every process of the slot's user, and none of them may signal it."""


def send_message(sock, message: object, fds: list[int] | tuple[int, ...] = ()) -> None:
    """A length-prefixed JSON message on a unix stream socket, ``fds`` passed with its header."""
    import socket

    body = json.dumps(message, separators=(",", ":")).encode()
    socket.send_fds(sock, [len(body).to_bytes(4, "big")], list(fds))
    sock.sendall(body)


def receive_message(sock) -> tuple[object, list[int]]:
    """The next message and the fds that came with it; EOFError when the peer closed."""
    import socket

    head, fds, _, _ = socket.recv_fds(sock, 4, 8)
    try:
        head += _exactly(sock, 4 - len(head))
        size = int.from_bytes(head, "big")
        if size > MAX_REQUEST:
            raise ValueError("message too large")
        return json.loads(_exactly(sock, size)), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _exactly(sock, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def zygote(sock_fd: int, role: str, limits: dict, entry) -> None:
    """The fork server of one slot's ``serve`` or ``judge`` sandbox. It runs no request itself:
    per request it forks a child (``_child``), waits for the verifier's stop or the request's
    deadline, kills the child and every process of the slot's user in this sandbox, empties /tmp,
    and replies ``done``. It exits when the verifier goes, or when it cannot confirm the clean-up."""
    import ctypes
    import socket
    import time

    if limits.get("uid") is None:
        raise SystemExit("the fork server needs a user of the slot's own (graftrl running as root)")
    libc = ctypes.CDLL(None, use_errno=True)
    os.chdir("/")
    sock = socket.socket(fileno=sock_fd)
    send_message(sock, {"ready": os.getpid()})
    while True:
        try:
            request, fds = receive_message(sock)
        except (EOFError, OSError, ValueError):
            return
        if not (
            isinstance(request, dict) and request.get("role") == role and len(fds) == 2 + (role == "judge")
        ):
            for fd in fds:
                os.close(fd)
            if request == {"stop": True}:
                continue  # the stop of a request this zygote already ended at its deadline
            return
        child = os.fork()
        if child == 0:
            _child(role, request, fds, limits, libc, entry)
        for fd in fds:
            os.close(fd)
        due = time.monotonic() + float(request["deadline_s"])
        gone = False
        while not gone and time.monotonic() < due:
            if select.select([sock], [], [], max(0.0, due - time.monotonic()))[0]:
                try:
                    for fd in receive_message(sock)[1]:
                        os.close(fd)
                except (EOFError, OSError, ValueError):
                    gone = True
                break
        os.kill(child, 9)  # it may still be root, before confine: its user's sweep would miss it
        os.waitpid(child, 0)
        clean = sweep(limits.get("uid")) and empty("/tmp")
        if gone or not clean:
            return
        send_message(sock, {"done": True})


def _child(role: str, request: dict, fds: list[int], limits: dict, libc, entry) -> None:
    """A forked child of the zygote: only the request's pipes, a fresh IPC namespace, the limits
    and the slot's user, then the role's code; it never returns to the zygote's loop."""
    code = 1
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(fds[2] if role == "judge" else devnull, 1)  # the judge's lines; the program's go nowhere
        os.dup2(devnull, 2)
        read_fd, write_fd = os.dup2(fds[0], 60), os.dup2(fds[1], 61)  # high, as a per-program sandbox's
        os.closerange(3, read_fd)  # the zygote's socket above all
        os.closerange(write_fd + 1, 1 << 20)
        if libc.unshare(0x08000000) != 0:  # CLONE_NEWIPC: no SysV or POSIX IPC object outlives it
            raise OSError("unshare")
        os.chdir("/tmp")
        entry.confine(limits)
        channel = entry.Channel(read_fd, write_fd)
        if role == "serve":
            entry.serve(channel, request["source"])
        else:
            entry.judge(channel, float(request["test_timeout_s"]), request["spec"])
        code = 0
    finally:
        os._exit(code)


def sweep(uid: int | None) -> bool:
    """Kill every process of ``uid`` in this PID namespace (a helper with effective ``uid`` sends
    ``kill(-1, SIGKILL)``, which no fork escapes); True once none is left."""
    import time

    if uid is None:
        return True
    for attempt in range(50):
        if not _alive(uid):
            return True
        helper = os.fork()
        if helper == 0:
            try:
                os.setresuid(SWEEPER_UID, uid, SWEEPER_UID)
                os.kill(-1, 9)
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
        time.sleep(0.001 * attempt)
    return not _alive(uid)


def _alive(uid: int) -> bool:
    """A process of ``uid`` that is not a zombie is in /proc."""
    for name in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{name}/status", encoding="utf-8") as handle:
            status = handle.read()
            if f"\nUid:\t{uid}\t" in status and not any(f"\nState:\t{z}" in status for z in "ZX"):
                return True
    return False


def empty(folder: str) -> bool:
    """Remove everything in ``folder``; True when it is empty."""
    import shutil

    for entry in os.scandir(folder):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
    return not os.listdir(folder)
