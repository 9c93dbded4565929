"""What runs inside the code verifier's sandbox: the first Python a sandboxed process executes.

Standard library only, and no graftrl import: the sandbox holds an interpreter and its standard
library, nothing else. ``graftrl.verifiers.sandbox`` passes this file's source with ``-c`` and a
role as the first argument:

- ``run``: apply the limits, drop privileges, then ``exec`` the program as ``__main__`` with the
  test's input on stdin (stdin/stdout tests; the verifier compares stdout outside the sandbox).
- ``serve``: apply the limits, drop privileges, load the program as a module named ``solution``
  (its ``if __name__ == "__main__":`` block does not run) and answer calls of its top-level
  functions on two pipes, arguments and results as data only (``encode``/``decode``).
- ``judge``: in a second sandbox of its own, run the tests (read from ``/sandbox/tests.json``) with
  each function of the program replaced by a proxy that calls it through those pipes, and print
  one JSON line per test on stdout for the verifier.
- ``zygote``: a fork server (``sandbox_fork``, whose source is the next argument) that runs
  ``serve`` or ``judge`` in a forked child per program (``reward.code.fork_server``).

Why two sandboxes for assert-style tests: the program never holds the tests, the harness or the
verdicts. It cannot read the tests (they are not in its sandbox), override ``assert`` or the
harness (they run in another process it cannot see: separate PID namespaces), fake a pass by
exiting early or printing (a pass is the judge's line on the judge's stdout, written after the
test's asserts ran), or return an object whose ``__eq__`` always holds (only data crosses).
"""

from __future__ import annotations

import ast
import json
import math
import os
import select
import sys

MAX_MESSAGE = 8 << 20
"""Largest message on the call pipes (bytes): a bigger result fails the test."""
SOLUTION_MODULE = "solution"
"""``__name__`` of the program in ``serve`` (so a ``__main__`` block does not run)."""
ROOT = os.environ.get("GRAFTRL_SANDBOX_DIR", "/sandbox")
"""Where the program and tests are: /sandbox in the sandbox; a temporary folder with ``reward.sandbox: none``."""
PROGRAM = f"{ROOT}/program.py"
SYNTAX_EXIT = 86
"""Exit code of ``run`` for a program that does not compile (the verifier reads it as a syntax error)."""
TESTS = f"{ROOT}/tests.json"


# ------------------------------------------------------------------ limits and privileges


def confine(limits: dict) -> None:
    """Resource limits (soft = hard, so the program cannot raise them), then, when started as root,
    a user of its own with no capabilities (the process count limit holds only for non-root users)."""
    import resource

    mib = 1 << 20
    for name, value in (
        ("RLIMIT_CPU", limits["cpu_s"]),
        ("RLIMIT_AS", limits["memory_mb"] * mib),
        ("RLIMIT_FSIZE", limits["file_mb"] * mib),
        ("RLIMIT_NOFILE", 64),
        ("RLIMIT_CORE", 0),
    ):
        resource.setrlimit(getattr(resource, name), (value, value))
    uid = limits.get("uid")
    if uid is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if limits.get("processes") is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"], limits["processes"]))


# ------------------------------------------------------------------ data across the pipes


def encode(value: object, depth: int = 0) -> object:
    """A value as JSON with tagged containers; anything that is not plain data raises TypeError."""
    if depth > 100:
        raise TypeError("data nested more than 100 levels")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if type(value) is int else {"i": int(value)}
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, complex):
        return {"c": [encode(value.real), encode(value.imag)]}
    if isinstance(value, bytes):
        return {"b": value.hex()}
    tags = ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "fs"))
    for kind, tag in tags:
        if type(value) is kind:
            return {tag: [encode(v, depth + 1) for v in value]}
    if type(value) is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(
        f"a {type(value).__name__} is not data (None, bool, numbers, str, bytes, list, tuple, set, dict)"
    )


def decode(value: object) -> object:
    """The value ``encode`` wrote; raises ValueError on anything else (a hostile peer's bytes)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError("malformed data")
    ((tag, inner),) = value.items()
    if tag == "i" and type(inner) is int:
        return inner
    if tag == "f" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if tag == "c" and isinstance(inner, list) and len(inner) == 2:
        return complex(decode(inner[0]), decode(inner[1]))
    if tag == "b" and isinstance(inner, str):
        return bytes.fromhex(inner)
    if not isinstance(inner, list):
        raise ValueError("malformed data")
    if tag == "l":
        return [decode(v) for v in inner]
    if tag == "t":
        return tuple(decode(v) for v in inner)
    if tag in ("s", "fs"):
        items = [decode(v) for v in inner]
        return set(items) if tag == "s" else frozenset(items)
    if tag == "d" and all(isinstance(kv, list) and len(kv) == 2 for kv in inner):
        return {decode(k): decode(v) for k, v in inner}
    raise ValueError("malformed data")


class Channel:
    """Newline-delimited JSON over two raw pipe ends, with a timeout on reads."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.buffer = b""

    def send(self, message: object) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        view = memoryview(data)
        while view:
            view = view[os.write(self.write_fd, view) :]

    def receive(self, timeout_s: float | None = None) -> object:
        """The next message; TimeoutError past ``timeout_s``, EOFError when the other end closed."""
        import time

        due = None if timeout_s is None else time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            if len(self.buffer) > MAX_MESSAGE:
                raise ValueError("message too large")
            wait = None if due is None else max(0.0, due - time.monotonic())
            if not select.select([self.read_fd], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(self.read_fd, 1 << 16)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


# ------------------------------------------------------------------ the program's side


def serve(channel: Channel, source: str) -> None:
    """Load the program, report its functions, answer calls until the pipe closes."""
    import types

    try:
        code = compile(source, "program.py", "exec")
    except SyntaxError as exc:
        channel.send({"load": "syntax_error", "detail": f"SyntaxError: {exc.msg} (line {exc.lineno})"})
        return
    except (ValueError, MemoryError, RecursionError) as exc:
        channel.send({"load": "syntax_error", "detail": f"{type(exc).__name__}: {exc}"})
        return
    module = types.ModuleType(SOLUTION_MODULE)
    sys.modules[SOLUTION_MODULE] = module
    try:
        exec(code, module.__dict__)
    except MemoryError:
        channel.send({"load": "memory", "detail": "MemoryError while loading the program"})
        return
    except BaseException as exc:  # the program's own top level raised or exited
        channel.send({"load": "crash", "detail": f"{type(exc).__name__} while loading: {exc}"[:300]})
        return
    functions = sorted(name for name, value in vars(module).items() if isinstance(value, types.FunctionType))
    channel.send({"load": "ok", "functions": functions})
    while True:
        try:
            request = channel.receive()
        except (EOFError, OSError):
            return
        try:
            function = getattr(module, request["name"])
            args = decode(request["args"])
            kwargs = decode(request["kwargs"])
            value = function(*args, **kwargs)
            reply: dict = {"value": encode(value)}
        except BaseException as exc:  # the program's exception, re-raised on the judge's side
            reply = {"raised": type(exc).__name__, "detail": str(exc)[:300]}
        try:
            channel.send(reply)
        except (ValueError, OverflowError, RecursionError) as exc:
            channel.send({"raised": "TypeError", "detail": f"result cannot be sent: {exc}"[:300]})


# ------------------------------------------------------------------ the judge's side


class ProgramGone(Exception):
    """The program died, hung or broke the protocol: this test and the program's process are over."""

    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


def judge(channel: Channel, timeout_s: float, spec: dict) -> None:
    """Run each test with proxies for the program's functions; one JSON line per test."""
    import builtins

    try:
        hello = channel.receive(timeout_s)
    except TimeoutError:
        return emit({"load": "timeout", "detail": "the program did not finish loading in time"})
    except (EOFError, OSError, ValueError):
        return emit({"load": "crash", "detail": "the program's process ended while loading"})
    if not isinstance(hello, dict) or hello.get("load") != "ok":
        return emit(
            hello if isinstance(hello, dict) and "load" in hello else {"load": "crash", "detail": "?"}
        )
    emit({"load": "ok"})
    raised: list[str] = []

    def proxy(name: str):
        def call(*args, **kwargs):
            try:
                request = {"name": name, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
            except TypeError as exc:
                raise TypeError(f"argument of {name}() cannot be sent to the program: {exc}") from None
            channel.send(request)
            try:
                reply = channel.receive(timeout_s)
            except TimeoutError:
                raise ProgramGone("timeout", f"{name}() ran past {timeout_s:g} s") from None
            except (EOFError, OSError):
                raise ProgramGone("crash", f"the program's process ended during {name}()") from None
            except ValueError as exc:
                raise ProgramGone("crash", f"unreadable reply from {name}(): {exc}") from None
            if not isinstance(reply, dict):
                raise ProgramGone("crash", f"unreadable reply from {name}()")
            if "raised" in reply:
                kind = str(reply["raised"])
                raised.append(kind)
                error = getattr(builtins, kind, None)
                if not (isinstance(error, type) and issubclass(error, Exception)):
                    error = RuntimeError
                raise error(f"{name}() raised {kind}: {reply.get('detail', '')}")
            try:
                return decode(reply.get("value"))
            except (ValueError, TypeError, RecursionError) as exc:
                raise ProgramGone("crash", f"unreadable result from {name}(): {exc}") from None

        call.__name__ = name
        return call

    base: dict = {"__name__": "__tests__"}
    for name in hello.get("functions", []):
        base[name] = proxy(name)
    if spec.get("setup"):
        exec(compile(spec["setup"], "setup", "exec"), base)
    entry = spec.get("entry_point")
    if entry and entry not in base:
        for index in range(len(spec["tests"])):
            emit({"test": index, "outcome": "fail", "detail": f"the program defines no function {entry!r}"})
        return None
    if entry:
        base["candidate"] = base[entry]
    for index, test in enumerate(spec["tests"]):
        raised.clear()
        namespace = dict(base)
        try:
            tree = compile(test, f"test {index}", "exec", ast.PyCF_ONLY_AST)
            exec(compile(tree, f"test {index}", "exec"), namespace)
            if entry and defines_check_only(tree):
                namespace["check"](namespace["candidate"])  # HumanEval: `def check(candidate)`
        except ProgramGone as gone:
            emit({"test": index, "outcome": gone.outcome, "detail": gone.detail})
            return None
        except AssertionError as exc:
            emit({"test": index, "outcome": "fail", "detail": f"AssertionError {exc}".strip()[:300]})
            continue
        except BaseException as exc:
            outcome = "memory" if raised and raised[-1] == "MemoryError" else "fail"
            emit({"test": index, "outcome": outcome, "detail": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        emit({"test": index, "outcome": "pass"})
    return None


def defines_check_only(tree: object) -> bool:
    """A HumanEval test: it defines ``check`` and never calls it at its top level."""
    body = getattr(tree, "body", [])
    defines = any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in body)
    calls = any(
        isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "check"
        for node in body
        if not isinstance(node, ast.FunctionDef)
        for call in ast.walk(node)
    )
    return defines and not calls


def emit(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    role, limits = argv[1], json.loads(argv[2])
    if role == "run":
        confine(limits)
        try:
            with open(PROGRAM, encoding="utf-8") as handle:
                compile(handle.read(), "program.py", "exec")
        except (SyntaxError, ValueError) as exc:
            sys.stderr.write(
                f"{type(exc).__name__}: {getattr(exc, 'msg', exc)} (line {getattr(exc, 'lineno', '?')})\n"
            )
            sys.stderr.flush()
            os._exit(SYNTAX_EXIT)
        os.closerange(3, 256)  # nothing but stdin, stdout and stderr reaches the program
        os.execv(sys.executable, [sys.executable, "-S", "-s", "-B", PROGRAM])
    if role == "zygote":  # the fork server: its source (``sandbox_fork``) comes as an argument
        fork: dict = {"__name__": "sandbox_fork"}
        exec(compile(argv[5], "sandbox_fork.py", "exec"), fork)
        return fork["zygote"](int(argv[3]), argv[4], limits, sys.modules[__name__])
    read_fd, write_fd = int(argv[3]), int(argv[4])
    if role == "serve":
        confine(limits)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the program's prints, tracebacks and input() reach nobody
            os.dup2(devnull, fd)
        with open(PROGRAM, encoding="utf-8") as handle:
            source = handle.read()
        serve(Channel(read_fd, write_fd), source)
    elif role == "judge":
        confine(limits)
        with open(TESTS, encoding="utf-8") as handle:
            spec = json.load(handle)
        judge(Channel(read_fd, write_fd), float(argv[5]), spec)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(sys.argv)
