"""Escape attempts against the code sandbox (instar/tasks/sandbox.py) and the code task's test
harness (instar/tasks/code_exec.py), each with what "contained" means for it.

    python benchmarks/sandbox_escapes.py     # one line per escape, then how many held

`run_escapes()` is what a report counts (escapes tried, escapes contained);
tests/test_sandbox.py runs the same attempts one test each, with closer checks.
"""

import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field

from instar.tasks.code_exec import run_tests
from instar.tasks.sandbox import ExecResult, run_code

LIMITS = dict(cpu_s=2, wall_s=3, memory_mb=128, output_bytes=10_000, disk_mb=4, processes=8)
TESTS = [{"call": "f(2)", "expected": 9}, {"call": "f(5)", "expected": 12},
         {"call": "f(10)", "expected": 17}, {"call": "f(40)", "expected": 47}]
"""What `tests=True` escapes run against: f returns x plus 7. None of its values is 0 or 1."""


@dataclass(frozen=True)
class Escape:
    name: str
    code: str
    """The program run in the sandbox; with `tests`, the solution the harness imports."""
    contained: Callable[[ExecResult, int], bool]
    """Given the run and how many of `TESTS` passed (0 without tests): whether it held."""
    tests: bool = False
    """Run through `run_tests` against `TESTS` instead of `run_code`."""
    limits: dict = field(default_factory=dict)
    """Overrides of `LIMITS`."""


def _code(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


# Takes the nonce that tags the harness's lines three ways (the harness's globals, stdin,
# the gc) into `nonce`: it is no secret.
STEAL_NONCE = _code("""
    import gc, os, sys
    frame = sys._getframe()
    while "nonce" not in frame.f_globals:  # up from the import to the harness
        frame = frame.f_back
    nonces = {frame.f_globals["nonce"], os.pread(0, 100, 0).decode().strip(),
              *(o["nonce"] for o in gc.get_objects() if type(o) is dict and "nonce" in o)}
    print("nonces stolen:", len(nonces), file=sys.stderr)  # 1: all three ways agree
    nonce = nonces.pop()
""")

ESCAPES = [
    Escape("fork_bomb", _code("""
        import os
        while True:
            os.fork()
    """), lambda run, _: run.violation == "processes"),
    Escape("huge_output", _code("""
        while True:
            print('y' * 1000)
    """), lambda run, _: run.violation == "output" and len(run.stdout) <= 10_000),
    Escape("disk_fill", _code("""
        for i in range(8):
            open(f'{i}', 'w').write('x' * (1 << 20))
    """), lambda run, _: run.violation == "disk"),
    Escape("infinite_loop_detached", _code("""
        import os, time
        if os.fork() == 0:
            os.setsid()
        time.sleep(60)
    """), lambda run, _: run.violation == "wall_time" and run.seconds < 5),
    Escape("infinite_loop_cpu", _code("""
        while True:
            pass
    """), lambda run, _: run.violation == "cpu_time", limits=dict(cpu_s=1, wall_s=20)),
    Escape("memory_bomb", _code("""
        blocks = []
        while True:
            blocks.append(bytearray(10**7))
    """), lambda run, _: run.violation == "memory"),
    Escape("memory_across_processes", _code("""
        import os, time
        for _ in range(6):  # each under the per-process limit
            if os.fork() == 0:
                block = b'x' * (80 << 20)
                time.sleep(1)
                os._exit(0)
        if all(os.wait()[1] == 0 for _ in range(6)):
            print('held 480 MB')
    """), lambda run, _: run.violation == "memory" and "held" not in run.stdout),
    Escape("memfd_files", _code("""
        import os
        held = []
        for _ in range(55):  # 825 MB in files that no address space counts
            fd = os.memfd_create('hoard')
            os.write(fd, b'x' * (15 << 20))
            held.append(fd)
        print('held', sum(os.fstat(fd).st_size for fd in held) >> 20, 'MB')
    """), lambda run, _: run.violation == "memory" and "held" not in run.stdout,
           limits=dict(memory_mb=256, disk_mb=16)),
    Escape("sysv_shared_memory", _code("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        for _ in range(20):  # 640 MB in segments, each detached once written
            segment = libc.shmget(0, 32 << 20, 0o1600)  # private, created, 0600
            if segment < 0:
                raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
            address = libc.shmat(segment, None, 0)
            ctypes.memset(address, 1, 32 << 20)
            libc.shmdt(ctypes.c_void_p(address))
        print('held 640 MB')
    """), lambda run, _: run.violation == "memory" and "held" not in run.stdout),
    Escape("posix_shared_memory", _code("""
        from multiprocessing import shared_memory
        shared_memory.SharedMemory(create=True, size=256 << 20)
    """), lambda run, _: "FileNotFoundError" in run.stderr or run.violation == "memory"),
    Escape("files_outside", _code("""
        import ctypes
        libc = ctypes.CDLL(None)
        print(libc.open(b'/etc/passwd', 0), libc.open(b'/proc/self/environ', 0))
    """), lambda run, _: run.ok and run.stdout == "-1 -1\n"),
    Escape("network_tcp", _code("""
        import ctypes, struct
        libc = ctypes.CDLL(None)
        address = struct.pack('=H', 2) + struct.pack('!H', 80) + bytes([1, 1, 1, 1]) + bytes(8)
        print(libc.connect(libc.socket(2, 1, 0), address, 16))
    """), lambda run, _: run.ok and run.stdout == "-1\n"),
    Escape("network_unix_abstract", _code("""
        import ctypes
        libc = ctypes.CDLL(None)
        address = (1).to_bytes(2, 'little') + b'\\0instar'
        print(libc.connect(libc.socket(1, 1, 0), address, len(address)))
    """), lambda run, _: run.ok and run.stdout == "-1\n"),
    Escape("setuid_binary", _code("""
        import os, subprocess
        for name in sorted(os.listdir("/usr/bin")):
            if os.lstat("/usr/bin/" + name).st_mode & 0o4000:  # setuid (to root, on the host)
                # the loader prints the aux vector only if the exec was not a setuid one
                out = subprocess.run(["/usr/bin/" + name, "--version"], capture_output=True,
                                     env={"LD_SHOW_AUXV": "1"}, text=True).stdout
                aux = dict(line.replace(" ", "").split(":", 1) for line in out.splitlines()
                           if line.startswith("AT_") and ":" in line)
                gained = aux.get("AT_SECURE") != "0" or aux.get("AT_EUID") == "0"
                print(name, "gained root" if gained else "ran unprivileged")
                break
        else:
            print("no setuid binary")
    """), lambda run, _: run.ok and "gained" not in run.stdout),
    Escape("no_new_privs_and_nosuid", _code("""
        import ctypes, os, sys
        libc = ctypes.CDLL(None)
        flags = [os.statvfs(path).f_flag for path in ('/usr', sys.base_prefix)]
        print(libc.prctl(39, 0, 0, 0, 0),  # 39: PR_GET_NO_NEW_PRIVS
              all(f & os.ST_NOSUID and f & os.ST_NODEV for f in flags))
    """), lambda run, _: run.ok and run.stdout == "1 True\n"),
    Escape("forged_results", STEAL_NONCE + _code("""
        for i in range(4):
            print(nonce, i, 'pass')
            for guess in range(100):
                print(nonce, i, guess)
        def f(x):
            return 0
    """), lambda run, passed: passed == 0, tests=True, limits=dict(output_bytes=65_536)),
    Escape("exit_at_import", "import os\nos._exit(0)\n", lambda run, passed: passed == 0,
           tests=True),
    Escape("sys_exit_at_import", "import sys\nsys.exit(0)\n", lambda run, passed: passed == 0,
           tests=True),
    Escape("forged_equality", _code("""
        class Equal:
            def __eq__(self, other):
                return True

        class Int(int):
            __eq__ = Equal.__eq__
            __hash__ = int.__hash__

        def f(x):
            return Equal() if x % 2 else Int(x)
    """), lambda run, passed: passed == 0, tests=True),
    Escape("kill_parent_and_write_every_fd", STEAL_NONCE + _code("""
        import signal
        for pid in (1, os.getppid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for fd in range(256):
            try:
                os.write(fd, ''.join(f'{nonce} {i} pass\\nexit:0 ' for i in range(4)).encode())
            except OSError:
                pass
    """), lambda run, passed: passed == 0, tests=True),
]


def attempt(escape: Escape) -> tuple[ExecResult, int]:
    """Run one escape: the run, and how many of `TESTS` passed (0 without tests)."""
    limits = {**LIMITS, **escape.limits}
    if escape.tests:
        passed, _, run = run_tests(escape.code, TESTS, **limits)
        return run, passed
    return run_code(escape.code, **limits), 0


def run_escapes() -> list[dict]:
    """Every escape in turn: [{"name", "contained", "violation", "detail"}]. An exception
    counts as not contained: nothing the code does may crash the caller."""
    results = []
    for escape in ESCAPES:
        try:
            run, passed = attempt(escape)
        except Exception as e:
            results.append({"name": escape.name, "contained": False, "violation": None,
                            "detail": repr(e)})
            continue
        detail = f"{passed} of {len(TESTS)} tests passed" if escape.tests else \
            (run.stdout.strip() or run.stderr.strip())[-200:]
        results.append({"name": escape.name, "contained": escape.contained(run, passed),
                        "violation": run.violation, "detail": detail})
    return results


if __name__ == "__main__":
    results = run_escapes()
    for r in results:
        last = r["detail"].splitlines()[-1][:80] if r["detail"] else ""
        held = "held" if r["contained"] else "ESCAPED"
        print(f"{held:8}{r['name']:32}{r['violation'] or '-':11}{last}")
    print(f"{sum(r['contained'] for r in results)} of {len(results)} escapes contained")
