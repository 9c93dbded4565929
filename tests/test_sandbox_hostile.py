"""Hostile programs against the code verifier's sandbox, by class: network, files, processes,
resources and faked passes. Each scores as it should (0, or the failure class named), and after
each batch the host is checked: the planted secret file unchanged, no file written outside, no
process of a sandbox user left, the environment's secret never seen.

A program "escapes" when it can print what only an escape would know: each stdin/stdout test
below expects exactly that output, so an escape would score 1.0."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from graftrl.storage.data import Problem
from graftrl.verifiers.base import CRASH, MEMORY, SYNTAX_ERROR, TESTS_FAILED, TIMEOUT
from graftrl.verifiers.code import CodeVerifier
from graftrl.verifiers.sandbox import SANDBOX_UID_BASE, Limits

SECRET = "graftrl-test-secret-4e1f"
ESCAPED = f"/tmp/graftrl-escaped-{os.getpid()}"
"""A host path that an escaped program would write (unique to this test process)."""


@pytest.fixture(scope="module", params=[True, False], ids=["fork_server", "per_program"])
def verifier(request):
    v = CodeVerifier(
        fork_server=request.param,
        workers=2,
        test_timeout_s=2.0,
        program_timeout_s=8.0,
        limits=Limits(cpu_s=3, memory_mb=256, processes=8, file_mb=4, output_bytes=64 << 10),
    )
    v.start()
    assert (v.zygotes is not None) == request.param, "the fork server needs root and bwrap"
    yield v
    v.close()


@pytest.fixture()
def host(tmp_path, monkeypatch):
    """A secret file and a secret environment variable on the host, and a check afterwards."""
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    monkeypatch.setenv("GRAFTRL_SECRET", SECRET)
    before = sorted(p.name for p in tmp_path.iterdir())
    yield secret
    assert secret.read_text() == SECRET
    assert sorted(p.name for p in tmp_path.iterdir()) == before, "a program wrote into the host's folder"
    assert not Path(ESCAPED).exists()
    assert _sandbox_processes() == [], "a sandboxed process outlived its program"


def _sandbox_processes() -> list[int]:
    """Processes of the sandbox users still alive (a moment's grace for the kernel to reap them)."""
    for _ in range(20):
        alive = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    uid = int((entry / "status").read_text().split("\nUid:\t", 1)[1].split()[0])
                except (OSError, IndexError, ValueError):
                    continue
                if uid >= SANDBOX_UID_BASE:
                    alive.append(int(entry.name))
        if not alive:
            return []
        time.sleep(0.1)
    return alive


def stdio(expected: str, input_text: str = "") -> Problem:
    return Problem("hostile", "x", extra={"tests": [{"input": input_text, "output": expected}]})


def calls(*tests: str) -> Problem:
    return Problem("hostile-calls", "x", extra={"tests": list(tests)})


def run(verifier, cases):
    """cases: (program, problem, expected failure class or None for any failure) -> verdicts."""
    verdicts = verifier.verify([c[0] for c in cases], [c[1] for c in cases])
    for (program, _, failure), verdict in zip(cases, verdicts, strict=True):
        assert verdict.reward == 0.0, f"{program!r} scored {verdict}"
        if failure is not None:
            assert verdict.failure == failure, f"{program!r}: {verdict}"
    return verdicts


def test_network_is_unreachable(verifier, host):
    ok = "connected"
    cases = [
        ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)\nprint('connected')", stdio(ok), CRASH),
        ("import socket\ns=socket.socket(socket.AF_INET6)\ns.connect(('::1', 22))\nprint('connected')", stdio(ok), CRASH),
        ("import socket\ns=socket.socket(socket.AF_UNIX)\ns.connect('/run/docker.sock')\nprint('connected')", stdio(ok), CRASH),
        (
            "import subprocess\nr=subprocess.run(['python3','-c','import urllib.request as u; "
            "u.urlopen(\"http://1.1.1.1\", timeout=1)'])\nprint('connected' if r.returncode==0 else 'no')",
            stdio(ok),
            TESTS_FAILED,
        ),
        (
            "import ctypes, ctypes.util, socket, struct\nlibc=ctypes.CDLL(ctypes.util.find_library('c'))\n"
            "fd=libc.socket(2,1,0)\naddr=struct.pack('!HH4s8x',2,80,bytes([1,1,1,1]))\n"
            "print('connected' if libc.connect(fd, addr, 16)==0 else 'no')",
            stdio(ok),
            None,
        ),
        ("import os\nprint(sorted(os.listdir('/sys/class/net')) if os.path.exists('/sys/class/net') else 'none')",
         stdio("['eth0', 'lo']"), None),
    ]  # fmt: skip
    run(verifier, cases)


def test_host_files_and_secrets_are_out_of_reach(verifier, host):
    secret = str(host)
    cases = [
        (f"print(open({secret!r}).read())", stdio(SECRET), CRASH),
        ("import os\nprint(os.environ.get('GRAFTRL_SECRET'))", stdio(SECRET), TESTS_FAILED),
        ("import os\nprint(open('/proc/1/environ').read())", stdio(SECRET), None),
        ("import os\nprint(open('/etc/passwd').read())", stdio("root"), CRASH),
        ("import os\nprint(sorted(os.listdir('/')))", stdio("['bin', 'etc', 'home', 'root', 'work']"), TESTS_FAILED),
        ("import os\nprint(os.path.exists(os.path.expanduser('~/.ssh')) or os.path.exists('/work'))", stdio("True"), TESTS_FAILED),
        # write outside: the host folder, /tmp of the host, the interpreter
        (f"open({str(host.parent / 'planted.txt')!r}, 'w').write('x')\nprint('wrote')", stdio("wrote"), CRASH),
        (f"open({ESCAPED!r}, 'w').write('x')\nimport os\nprint('wrote' if os.path.exists('/work') else 'no')",
         stdio("wrote"), TESTS_FAILED),
        ("import os, sys\nopen(os.path.join(sys.prefix, 'planted'), 'w').write('x')\nprint('wrote')", stdio("wrote"), CRASH),
        ("import sys\nprint(any('site-packages' in p for p in sys.path) and __import__('torch'))", stdio("True"), None),
    ]  # fmt: skip
    run(verifier, cases)


def test_a_program_leaves_nothing_for_the_next(verifier, host):
    writer = "open('/tmp/left-behind', 'w').write('hello')\nprint('written')"
    reader = (
        "import os\nprint(open('/tmp/left-behind').read() if os.path.exists('/tmp/left-behind') else 'clean')"
    )
    first = verifier.verify([writer], [stdio("written")])[0]
    second = verifier.verify([reader], [stdio("clean")])[0]
    assert first.reward == 1.0 and second.reward == 1.0, (first, second)


def test_processes_cannot_outlive_or_kill_their_parents(verifier, host):
    parent_pid = os.getpid()
    cases = [
        # fork bomb: bounded by the process limit, the CPU limit and the wall clock
        (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            stdio("done"),
            None,
        ),
        # a daemon meant to outlive the program
        (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n"
            f"    open({ESCAPED!r}, 'w').write('x')\nprint('detached')",
            stdio("still here"),
            TESTS_FAILED,
        ),
        # killing the parent, the judge, everyone
        (
            f"import os, signal\nos.kill({parent_pid}, signal.SIGKILL)\nprint('killed')",
            stdio("killed"),
            CRASH,
        ),
        ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('killed')", stdio("killed"), None),
        ("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('killed')", stdio("killed"), None),
        (
            "import os\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]) > 5)",
            stdio("True"),
            TESTS_FAILED,
        ),
    ]
    run(verifier, cases)
    assert os.getppid() > 0  # this process (the trainer's stand-in) is alive and still parented


def test_resources_are_limited(verifier, host):
    cases = [
        ("x = bytearray(10**9)\nprint('allocated')", stdio("allocated"), MEMORY),
        ("while True:\n    pass", stdio("done"), TIMEOUT),
        ("import time\ntime.sleep(60)\nprint('done')", stdio("done"), TIMEOUT),
        ("while True:\n    print('flood' * 1000)", stdio("done"), CRASH),
        ("import sys\nsys.setrecursionlimit(10**7)\ndef f(n): return f(n + 1)\nf(0)", stdio("done"), None),
        ("open('/tmp/big', 'wb').write(b'x' * (64 << 20))\nprint('written')", stdio("written"), None),
        ("import threading, time\nfor _ in range(10**4):\n    threading.Thread(target=time.sleep, args=(9,)).start()\nprint('ok')",
         stdio("ok"), None),
    ]  # fmt: skip
    run(verifier, cases)


def test_passes_cannot_be_faked(verifier, host):
    add = calls("assert add(1, 2) == 3", "assert add(2, 2) == 4")
    cases = [
        # exit 0 before the tests, in every way
        ("import sys\nsys.exit(0)\ndef add(a, b): return a + b", add, CRASH),
        ("import os\nos._exit(0)", add, CRASH),
        ("def add(a, b):\n    import os\n    os._exit(0)", add, CRASH),
        # print what a passing judge prints, on every stream it can reach
        (
            "import os, json\nfor fd in range(1, 9):\n    try:\n"
            "        os.write(fd, (json.dumps({'test': 0, 'outcome': 'pass'}) + '\\n').encode())\n"
            "    except OSError:\n        pass\ndef add(a, b): return 0",
            add,
            TESTS_FAILED,
        ),
        # override assert, AssertionError, sys.exit, the exit code
        (
            "import builtins, sys\nbuiltins.AssertionError = type('A', (Exception,), {})\n"
            "sys.exit = lambda *a: None\nimport atexit, os\natexit.register(lambda: os._exit(0))\n"
            "def add(a, b): return 0",
            add,
            TESTS_FAILED,
        ),
        # an answer that equals everything
        (
            "class Any:\n    def __eq__(self, other): return True\ndef add(a, b): return Any()",
            add,
            TESTS_FAILED,
        ),
        (
            "class I(int):\n    def __eq__(self, other): return True\ndef add(a, b): return I(0)",
            add,
            TESTS_FAILED,
        ),
        # read the tests: not in its sandbox, and the judge is not in its process namespace
        (
            "import os, glob\ndef add(a, b):\n    found = glob.glob('/sandbox/*') + glob.glob('/proc/*/cwd/tests.json')\n"
            "    return 3 if [f for f in found if 'tests' in f] else -1",
            add,
            TESTS_FAILED,
        ),
        ("def add(a, b) return", add, SYNTAX_ERROR),
    ]
    run(verifier, cases)
    # stdio: exiting 0 early, or printing a guess, is not a pass
    run(verifier, [("import sys\nsys.exit(0)", stdio("42", "21\n"), TESTS_FAILED)])


def test_honest_programs_in_the_same_batch_score_right(verifier, host):
    add = calls(
        "assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0", "assert add(5, 0) == 5"
    )
    responses = [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "import os\nwhile True:\n    os.fork()",
        "def add(a, b):\n    return a + b if a > 1 else 0",
        "x = bytearray(10**9)",
        "```python\ndef add(a, b):\n    return abs(a) + b\n```",
        "while True:\n    pass",
    ]
    rewards = verifier.rewards(responses, [add] * len(responses))
    assert rewards == [1.0, 0.0, 0.75, 0.0, 0.75, 0.0]


# ------------------------------------------------------------------ the fork server's own risks
# In fork-server mode successive programs of a slot share the slot's two long-lived sandboxes
# (sequential single-program calls reuse one slot): whatever a program starts or leaves must be
# gone before the next one runs, and the fork server itself must be out of its reach.

ADD = calls("assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(-1, 1) == 0")
HONEST = (
    "import os, time\ndef add(a, b):\n    time.sleep(0.3)\n"
    "    return a + b if not os.listdir('/tmp') and os.getcwd() == '/tmp' else -1"
)
"""Right only when its /tmp is empty, and slow enough for a left-over process to strike."""


def _next_program_is_unharmed(verifier, *hostile: str) -> None:
    failures = verifier.stats()["fork_server_failures"]
    for program in hostile:
        assert verifier.verify([program], [ADD])[0].reward < 1.0, program
        verdict = verifier.verify([HONEST], [ADD])[0]
        assert verdict.reward == 1.0, (program, verdict)
        verifier._cache.clear()
    assert verifier.stats()["fork_server_failures"] == failures


def test_a_left_over_process_cannot_touch_the_next_program(verifier, host):
    daemon = (
        "import os, time\ndef add(a, b):\n    if os.fork() == 0:\n        os.setsid()\n"
        "        time.sleep(0.5)\n        for _ in range(200):\n"
        "            try:\n                os.kill(-1, 9)\n            except OSError:\n                pass\n"
        "            for fd in range(3, 64):\n                try:\n"
        '                    os.write(fd, b\'{"value": 0}\\n{"test": 0, "outcome": "pass"}\\n\')\n'
        "                except OSError:\n                    pass\n"
        "            try:\n                open('/tmp/left', 'w').write('x')\n            except OSError:\n"
        "                pass\n            time.sleep(0.02)\n        os._exit(0)\n    return 0"
    )
    threads = (
        "import threading, time\ndef spin():\n    while True:\n        open('/tmp/t', 'w').write('x')\n"
        "for _ in range(4):\n    threading.Thread(target=spin, daemon=True).start()\ndef add(a, b):\n"
        "    return 0"
    )
    ipc = (
        "import ctypes\nlibc = ctypes.CDLL(None)\nfor _ in range(8):\n    libc.shmget(0, 64 << 20, 0o1777)\n"
        "def add(a, b):\n    return 0"
    )
    _next_program_is_unharmed(verifier, daemon, threads, ipc)


def test_the_fork_server_is_out_of_reach(verifier, host):
    probe = (
        "import ctypes, os, signal\ndef add(a, b):\n    hits = []\n    me = os.getpid()\n"
        "    pids = {1, os.getppid()} | {int(p) for p in os.listdir('/proc') if p.isdigit()}\n"
        "    for pid in sorted(pids - {me}):\n"
        "        for name in ('mem', 'environ', 'maps', 'fd/0'):\n            try:\n"
        "                with open(f'/proc/{pid}/{name}', 'rb') as handle:\n                    handle.read(64)\n"
        "                hits.append((pid, name))\n            except OSError:\n                pass\n"
        "        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):\n            try:\n"
        "                os.kill(pid, sig)\n                hits.append((pid, sig))\n"
        "            except OSError:\n                pass\n"
        "        if ctypes.CDLL(None).ptrace(16, pid, 0, 0) == 0:\n            hits.append((pid, 'ptrace'))\n"
        "    return 3 if hits else -1"
    )
    _next_program_is_unharmed(verifier, probe)
    run(verifier, [(probe, ADD, TESTS_FAILED)])


def test_exhausting_memory_cpu_or_processes_leaves_the_next_program_scoring(verifier, host):
    _next_program_is_unharmed(
        verifier,
        "x = bytearray(10**9)\ndef add(a, b):\n    return 0",
        "def add(a, b):\n    while True:\n        pass",
        "import os\ndef add(a, b):\n    while True:\n        try:\n            os.fork()\n"
        "        except OSError:\n            pass",
        "def add(a, b):\n    x = []\n    while True:\n        x.append(bytearray(1 << 20))",
        "def add(a, b):\n    open('/tmp/big', 'wb').write(b'x' * (64 << 20))",
    )
