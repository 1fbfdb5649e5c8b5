"""The code sandbox: one test per escape; each checks containment, the reported reason, and
that nothing is left running and the caller can go on."""

import os
import signal
import socket
import time

from instar.tasks.sandbox import run_code

LIMITS = dict(cpu_s=2, wall_s=3, memory_mb=128, output_bytes=10_000, disk_mb=4, processes=8)


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
