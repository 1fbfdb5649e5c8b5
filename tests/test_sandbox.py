"""The code sandbox: one test per escape; each checks containment, the reported reason, and
that nothing is left running and the caller can go on."""

import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path

import pytest

from instar.tasks import sandbox
from instar.tasks.code_exec import run_tests
from instar.tasks.sandbox import run_code

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
try:  # the escapes a reliability report counts; the tests below try them, with closer checks
    from sandbox_escapes import ESCAPES, STEAL_NONCE, TESTS, attempt
finally:
    sys.path.pop(0)

LIMITS = dict(cpu_s=2, wall_s=3, memory_mb=128, output_bytes=10_000, disk_mb=4, processes=8)
ESCAPE = {escape.name: escape for escape in ESCAPES}


def sandboxed_processes() -> list[int]:
    """Pids still running sandboxed code (their command line holds the guard's run_path)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b'run_path("/work/main.py"' in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def assert_caller_fine() -> None:
    for _ in range(40):
        if not sandboxed_processes():
            break
        time.sleep(0.05)
    assert sandboxed_processes() == []
    assert run_code("print(6 * 7)", **LIMITS).stdout == "42\n"


def test_stdin_to_stdout():
    result = run_code("print(input()[::-1])", stdin="hello\n", **LIMITS)
    assert result.ok and result.stdout == "olleh\n" and result.stderr == ""
    assert run_code("import sys; sys.exit(3)", **LIMITS).returncode == 3


def test_code_against_given_tests():
    tests = "from solution import add\nassert add(2, 3) == 5\nassert add(-1, 1) == 0\nprint('ok')"
    good = run_code(tests, files={"solution.py": "def add(a, b):\n    return a + b\n"}, **LIMITS)
    assert good.ok and good.stdout == "ok\n"
    bad = run_code(tests, files={"solution.py": "def add(a, b):\n    return a - b\n"}, **LIMITS)
    assert bad.returncode == 1 and bad.violation is None
    assert 'File "/work/main.py", line 2' in bad.stderr and "AssertionError" in bad.stderr


def test_fork_bomb():
    result = run_code("import os\nwhile True:\n    os.fork()", **LIMITS)
    assert result.violation == "processes" and "BlockingIOError" in result.stderr
    assert_caller_fine()


def test_huge_output():
    result = run_code("while True:\n    print('y' * 1000)", **LIMITS)
    assert result.violation == "output" and result.returncode == -signal.SIGKILL
    assert 9_000 <= len(result.stdout) <= 10_000 and result.seconds < LIMITS["wall_s"]
    big_file = run_code("open('big', 'w').write('x' * (8 << 20))", **LIMITS)
    assert big_file.violation == "disk" and "File too large" in big_file.stderr
    many_files = "for i in range(8):\n    open(f'{i}', 'w').write('x' * (1 << 20))"
    disk = run_code(many_files, **LIMITS)
    assert disk.violation == "disk" and "No space left on device" in disk.stderr
    assert_caller_fine()


def test_infinite_loop_wall_time():
    # the child leaves the process group and session: the namespace still ends it
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)"
    result = run_code(code, **LIMITS)
    assert result.violation == "wall_time" and result.timed_out
    assert LIMITS["wall_s"] <= result.seconds < LIMITS["wall_s"] + 2
    assert_caller_fine()


def test_infinite_loop_cpu_time():
    # a wall limit to spare: on a busy machine one CPU second can take several wall seconds
    result = run_code("while True:\n    pass", **{**LIMITS, "cpu_s": 1, "wall_s": 20})
    assert result.violation == "cpu_time" and result.returncode == -signal.SIGXCPU
    assert_caller_fine()


def test_memory_bomb():
    result = run_code("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", **LIMITS)
    assert result.violation == "memory" and result.stderr.rstrip().endswith("MemoryError")
    assert_caller_fine()


def test_reading_files_outside(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    result = run_code(f"print(open({str(secret)!r}).read())", **LIMITS)
    assert result.violation == "filesystem" and "PermissionError" in result.stderr
    assert "hunter2" not in result.stdout + result.stderr
    # past the audit hook (raw libc calls), the files are simply not there
    code = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            f"print(libc.open({str(secret).encode()!r}, 0), libc.open(b'/etc/passwd', 0))")
    raw = run_code(code, **LIMITS)
    assert raw.ok and raw.stdout == "-1 -1\n"
    assert_caller_fine()


def test_socket_to_host_listener():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        result = run_code(code, **LIMITS)
        assert result.violation == "network" and "PermissionError" in result.stderr
        # past the audit hook (raw libc calls), the network namespace has no route
        raw = run_code(
            "import ctypes, struct\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "address = struct.pack('=H', 2) + struct.pack('!H', " + str(port) + ")"
            " + bytes([127, 0, 0, 1]) + bytes(8)\n"
            "print(libc.connect(libc.socket(2, 1, 0), address, 16), ctypes.get_errno())",
            **LIMITS)
        assert raw.ok and raw.stdout.split()[0] == "-1"
        server.settimeout(0.2)
        try:
            server.accept()
            raise AssertionError("the sandbox reached the host's listener")
        except TimeoutError:
            pass
    assert_caller_fine()


def test_unix_sockets_to_host_listeners(tmp_path):
    path = str(tmp_path / "host.sock")
    abstract = "\0instar-sandbox-test"
    with socket.socket(socket.AF_UNIX) as on_disk, socket.socket(socket.AF_UNIX) as in_ns:
        on_disk.bind(path)
        in_ns.bind(abstract)
        for server in (on_disk, in_ns):
            server.listen()
            server.settimeout(0.2)
        code = (f"import socket\nfor address in ({path!r}, {abstract!r}):\n"
                "    try:\n        socket.socket(socket.AF_UNIX).connect(address)\n"
                "        print('connected')\n    except OSError as e:\n"
                "        print(type(e).__name__)\n")
        result = run_code(code, **LIMITS)
        assert result.violation == "network" and result.stdout == "PermissionError\n" * 2
        # past the audit hook (raw libc calls): no such file, and the abstract name belongs
        # to the host's network namespace
        raw = run_code(
            "import ctypes, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            f"for address in ({path.encode()!r}, {abstract.encode()!r}):\n"
            "    sock = libc.socket(socket.AF_UNIX, socket.SOCK_STREAM, 0)\n"
            "    raw = socket.AF_UNIX.to_bytes(2, 'little') + address\n"
            "    print(libc.connect(sock, raw, len(raw)), ctypes.get_errno())\n", **LIMITS)
        assert raw.ok and [line.split()[0] for line in raw.stdout.splitlines()] == ["-1", "-1"]
        for server in (on_disk, in_ns):
            try:
                server.accept()
                raise AssertionError("the sandbox reached a host unix socket")
            except TimeoutError:
                pass
    assert_caller_fine()


def test_memfd_files_beyond_the_memory_limit(monkeypatch):
    """825 MB of memfds (no address space counts them) under a 256 MB limit: the memory
    cgroup kills the code; where none can be made, seccomp refuses memfd_create."""
    run, _ = attempt(ESCAPE["memfd_files"])
    assert run.violation == "memory" and "held" not in run.stdout
    monkeypatch.setattr(sandbox, "_memory_cgroup", lambda limit: None)
    run, _ = attempt(ESCAPE["memfd_files"])
    assert run.violation == "memory" and "Cannot allocate memory" in run.stderr
    assert_caller_fine()


def test_shared_memory_beyond_the_memory_limit(monkeypatch):
    """SysV segments written and detached (640 MB) count in the cgroup, or shmget is refused;
    POSIX shared memory has no /dev/shm to live in."""
    run, _ = attempt(ESCAPE["sysv_shared_memory"])
    assert run.violation == "memory" and "held" not in run.stdout
    monkeypatch.setattr(sandbox, "_memory_cgroup", lambda limit: None)
    run, _ = attempt(ESCAPE["sysv_shared_memory"])
    assert run.violation == "memory" and "Cannot allocate memory" in run.stderr
    run, _ = attempt(ESCAPE["posix_shared_memory"])
    assert run.returncode == 1 and "FileNotFoundError" in run.stderr
    assert_caller_fine()


def test_memory_across_processes():
    """Six processes of 80 MB, each under the 128 MB limit: the cgroup holds them together."""
    cgroup = sandbox._memory_cgroup(1 << 20)
    if cgroup is None:
        pytest.skip("no memory cgroup can be made here: memory is bounded per process")
    sandbox._close_cgroup(*cgroup)
    run, _ = attempt(ESCAPE["memory_across_processes"])
    assert run.violation == "memory" and "held" not in run.stdout
    assert_caller_fine()


def test_setuid_binaries_grant_nothing():
    run, _ = attempt(ESCAPE["no_new_privs_and_nosuid"])
    assert run.ok and run.stdout == "1 True\n"  # no_new_privs set; /usr nosuid and nodev
    setuid = [name for name in os.listdir("/usr/bin")
              if os.lstat(f"/usr/bin/{name}").st_mode & stat.S_ISUID]
    run, _ = attempt(ESCAPE["setuid_binary"])  # runs the first one with LD_SHOW_AUXV=1
    expected = "ran unprivileged\n" if setuid else "no setuid binary\n"
    assert run.ok and run.stdout.endswith(expected)
    assert_caller_fine()


def test_forged_test_results():
    """Code that takes the nonce (frames, stdin, gc) and prints pass lines and 100 guesses per
    test passes none; one value per test, so even the right function loses a test it also
    reports a guess for."""
    assert run_tests("def f(x):\n    return x + 7\n", TESTS, **LIMITS)[0] == 4
    run, passed = attempt(ESCAPE["forged_results"])
    assert passed == 0 and "nonces stolen: 1" in run.stderr
    code = STEAL_NONCE + "print(nonce, 0, 9)\nprint(nonce, 0, 8)\ndef f(x):\n    return x + 7\n"
    passed, wrong, _ = run_tests(code, TESTS, **LIMITS)
    assert passed == 3 and wrong == ["f(2) reported 2 different values"]


def test_exiting_at_import_passes_nothing():
    for name in ("exit_at_import", "sys_exit_at_import"):
        run, passed = attempt(ESCAPE[name])
        assert passed == 0 and run.returncode == 0 and run.violation is None


def test_forged_equality_passes_nothing():
    """Values cross as JSON: an object equal to everything does not serialise, and an int
    subclass arrives as its plain value."""
    passed, wrong, run = run_tests(ESCAPE["forged_equality"].code, TESTS, **LIMITS)
    assert passed == 0 and run.stderr.count("not JSON serializable") == 1
    assert wrong == ["f(2) returned 2, expected 9", "f(10) returned 10, expected 17",
                     "f(40) returned 40, expected 47"]


def test_killing_the_parent_and_writing_every_fd_passes_nothing():
    run, passed = attempt(ESCAPE["kill_parent_and_write_every_fd"])
    assert passed == 0 and run.returncode == 0  # pid 1 lived to report the exit
    assert_caller_fine()
