"""Run untrusted Python in a throwaway sandbox: the executor behind code-execution tasks.

`run_code(code, stdin=..., files=...)` runs `code` as `/work/main.py` and returns an
`ExecResult`. Nothing the code does can crash or hang the caller: every escape attempt either
fails inside the sandbox or ends the run, and is reported as `ExecResult.violation`.

    caller: run_code                    launcher: this file, run as a script
    ────────────────                    ────────────────────────────────────
    makes a memory cgroup, writes  ───▶ joins the cgroup; unshare: new mount, net, pid,
      config.json                         ipc, uts namespaces
    reads stdout, stderr, ctl, hints    └ fork: pid 1 of the new pid namespace
      (each capped, until the deadline)   tmpfs root, read-only nosuid /usr, /lib*, Python
    on wall time or output overflow:      └ fork: the code's process; both chroot
      SIGKILL the launcher's group          writes /work, takes a fresh uid, sets rlimits
      (pid 1 is in it); once pid 1          and no_new_privs (seccomp without a cgroup),
      is gone the kernel kills the rest     execs python -I: audit hook, then main.py
    reads the cgroup's OOM kills and    pid 1 waits, reports the exit status on ctl
      removes it

Containment, per escape (the kernel does it; the audit hook only explains and reports):
- infinite loop: the caller's wall-clock deadline kills everything (setsid and double forks
  included, as above); RLIMIT_CPU stops each process after `cpu_s` CPU seconds (rounded up).
- memory bomb: RLIMIT_AS of `memory_mb` per process (Python raises MemoryError), and a
  memory cgroup around the whole sandbox holding at most `memory_mb + disk_mb`, swap
  included: every process, memfds, SysV shared memory, pipes and /work's files count. The
  OOM killer takes the code's processes first (oom_score_adj 1000); an OOM kill is reported
  as "memory". The cgroup is made inside the caller's own: v2 where its subtree_control
  holds "memory", else v1's memory hierarchy; that takes root or a delegated cgroup. Where
  none can be made, a seccomp filter makes memfd_create and shmget (and every call of
  another ABI) fail with ENOMEM; POSIX shared memory needs /dev/shm, which is not there.
- fork bomb: RLIMIT_NPROC of `processes`. Root ignores that limit, so as root the code runs
  under a random unprivileged uid (60000-64999; two runs that draw the same one share the
  limit); without root, in a new user namespace, where the kernel counts per namespace.
- huge output: each stream is read as it comes and the run is killed past `output_bytes`;
  files go to a tmpfs with `disk_mb` free (RLIMIT_FSIZE too), gone with the mount namespace.
- files outside /work: chroot into a tmpfs that holds only /work, read-only binds of /usr,
  /bin, /lib* and the Python installation, and /dev/{null,zero,random,urandom}. There is no
  /etc, /home, /root, /tmp, /proc or /sys; the project's venv is not there (stdlib only).
- network: an empty network namespace (no interface is up, not even loopback). Unix
  sockets reach nothing either: no host socket file is inside the root, and abstract ones
  belong to the network namespace.
- privileges: the code's process sets no_new_privs before its exec, so setuid bits and file
  capabilities grant nothing; the system binds are nosuid and nodev besides read-only.
- the reports: the exit status goes on ctl, which the code's process does not inherit, from
  pid 1, which it cannot trace (pid 1 is not dumpable and holds capabilities the code lacks).

Known limits: measured where this was written (Linux 6.18, root, cgroup v1 memory hierarchy
with v2 mounted beside it for hugetlb only): the v1 cgroup is used; a trivial run charges it
about 9 MB. Without a cgroup, memory is bounded per process: worst case `processes` x
(`memory_mb` + pipe, socket and message-queue buffers) + `disk_mb`; off x86_64 and aarch64
there is no seccomp filter either, so memfds add up to RLIMIT_NOFILE (64) x RLIMIT_FSIZE
(`disk_mb`) per process. System directories and the Python installation are readable (not
secret, but not hidden). Hints come from inside the sandbox, so code can forge or dodge its
own label, never its containment (OOM kills are counted outside). Needs Linux and root or
unprivileged user namespaces; otherwise `run_code` raises RuntimeError: there is no
unsandboxed fallback. Agent-facing: stdlib only, no torch or ray.
"""

import contextlib
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

VIOLATIONS = ("wall_time", "cpu_time", "memory", "processes", "output", "disk", "network",
              "filesystem")
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/work", "TMPDIR": "/work"}
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64")

# Runs first in the sandboxed interpreter; hints go to fd 3.
_GUARD = """
import os, runpy, sys

def hint(word):
    try:
        os.write(3, word.encode() + b" ")
    except OSError:
        pass

def audit(event, args, readable=(sys.base_prefix + "/", "/usr/", "/lib/", "/dev/", "/work/")):
    if event == "open" and not isinstance(args[0], int):
        path = os.path.abspath(os.fsdecode(args[0]))
        if not (path + "/").startswith(readable):
            hint("filesystem")
            raise PermissionError(f"sandbox: {path} is outside /work")
    elif (event == "socket.__new__" and args[1] in (-1, 2, 10)
          or event == "socket.connect" and args[0].family == 1):  # 1: AF_UNIX
        hint("network")
        raise PermissionError("sandbox: no network")

def excepthook(kind, exc, tb):
    if issubclass(kind, MemoryError) or issubclass(kind, OSError) and exc.errno == 12:
        hint("memory")  # 12: ENOMEM, e.g. a memfd refused where no memory cgroup exists
    elif issubclass(kind, BlockingIOError):
        hint("processes")
    elif issubclass(kind, OSError) and exc.errno in (27, 28):
        hint("disk")
    while tb and tb.tb_next and not tb.tb_frame.f_code.co_filename.startswith("/work/"):
        tb = tb.tb_next
    sys.__excepthook__(kind, exc, exc.with_traceback(tb).__traceback__)

sys.excepthook = excepthook
sys.path.insert(0, "/work")
sys.addaudithook(audit)
runpy.run_path("/work/main.py", run_name="__main__")
"""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """What one sandboxed run did.

    Example: `ExecResult(returncode=0, stdout="6\\n", stderr="", violation=None, seconds=0.1)`.
    """

    returncode: int
    """The code's exit status; negative for a signal (-9 when the caller killed the run)."""
    stdout: str
    """Standard output: its first `output_bytes` bytes, decoded as UTF-8 (errors replaced)."""
    stderr: str
    """Standard error, capped the same way."""
    violation: str | None
    """The limit or rule the code ran into (one of `VIOLATIONS`), or None."""
    seconds: float
    """Wall-clock time of the whole run, sandbox set-up included."""

    @property
    def timed_out(self) -> bool:
        """Stopped by the wall-clock or the CPU-time limit."""
        return self.violation in ("wall_time", "cpu_time")

    @property
    def ok(self) -> bool:
        """Exited 0 without a violation."""
        return self.returncode == 0 and self.violation is None


def run_code(code: str, *, stdin: str = "", files: dict[str, str] | None = None,
             cpu_s: float = 5.0, wall_s: float = 10.0, memory_mb: int = 256,
             output_bytes: int = 65_536, disk_mb: int = 16, processes: int = 16) -> ExecResult:
    """Run `code` as `/work/main.py` beside `files` (relative path -> text), fed `stdin`.

    Limits: `cpu_s` CPU seconds and `memory_mb` of address space per process, `wall_s` for
    the whole run, `output_bytes` kept of each output stream, `disk_mb` for /work, and
    `processes` (threads included) alive at once; where a memory cgroup can be made,
    `memory_mb + disk_mb` of memory for the whole run (see the module's docstring).
    """
    files = files or {}
    if any(os.path.isabs(name) or ".." in name.split("/") for name in files):
        raise ValueError(f"files: names must be relative paths inside /work, got {list(files)}")
    if min(cpu_s, wall_s, memory_mb, output_bytes, disk_mb, processes) <= 0:
        raise ValueError("run_code: every limit must be positive")
    start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="instar-sandbox-")
    ctl_r, ctl_w = os.pipe()
    hints_r, hints_w = os.pipe()
    prefix = os.path.realpath(sys.base_prefix)  # the Python installation, bound read-only
    given = sum(len(text.encode(errors="replace")) + 8192  # given files and stdin always fit
                for text in (stdin, code, *files.values()))
    cgroup = _memory_cgroup(((memory_mb + disk_mb) << 20) + given)
    config = dict(code=code, stdin=stdin, files=files, cpu_s=cpu_s, memory_mb=memory_mb,
                  disk_mb=disk_mb, processes=processes, ctl=ctl_w, hints=hints_w, prefix=prefix,
                  cgroup=cgroup and cgroup[0],
                  python=f"{prefix}/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f)
        with subprocess.Popen([sys.executable, "-I", "-S", __file__, tmp], cwd=tmp, env=_ENV,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, pass_fds=(ctl_w, hints_w),
                              start_new_session=True) as proc:
            os.close(ctl_w)
            os.close(hints_w)
            ctl_w = hints_w = -1
            try:
                fds = [proc.stdout.fileno(), proc.stderr.fileno(), ctl_r, hints_r]
                data, violation = _drain(fds, start + wall_s, output_bytes)
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for fd in (ctl_r, ctl_w, hints_r, hints_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
        if cgroup and _close_cgroup(*cgroup):
            violation = violation or "memory"  # the OOM killer acted, maybe on pid 1
    out, err, ctl, hints = (bytes(data[fd][:output_bytes]).decode(errors="replace") for fd in fds)
    if "setup-failed" in ctl or (violation is None and "exit:" not in ctl):
        from instar.errors import InfraError  # (here: this file also runs in the sandbox)

        raise InfraError(f"the sandbox could not start:\n{err}")
    exits = [int(word[5:]) for word in ctl.split() if word.startswith("exit:")]
    reported = [word for word in ctl.split() + hints.split() if word in VIOLATIONS]
    return ExecResult(returncode=exits[-1] if exits else proc.returncode, stdout=out,
                      stderr=err, violation=violation or next(iter(reported), None),
                      seconds=time.monotonic() - start)


def _drain(fds: list[int], deadline: float, cap: int) -> tuple[dict[int, bytearray], str | None]:
    """Read `fds` to EOF, stopping early at the deadline or once one holds over `cap` bytes."""
    data = {fd: bytearray() for fd in fds}
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                return data, "wall_time"
            for key, _ in selector.select(timeout):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                data[key.fd] += chunk
                if len(data[key.fd]) > cap:
                    return data, "output"
    return data, None


# cgroup version: (memory limit, swap limit (absent without swap accounting), what counts
# OOM kills: a line "oom_kill N" in both versions)
_CGROUP_FILES = {2: ("memory.max", "memory.swap.max", "memory.events"),
                 1: ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "memory.oom_control")}


def _memory_cgroup(limit: int) -> tuple[str, int] | None:
    """A new memory cgroup inside this process's own that holds at most `limit` bytes, swap
    included: (its directory, its version); None where none can be made (no memory
    controller for a child, or no permission)."""
    mounts = {}  # "cgroup2" or "cgroup" (v1's memory hierarchy) -> where it is mounted
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields, _, fs = line.partition(" - ")
            root, point = fields.split()[3:5]
            fs_type, _, options = fs.split()
            if root == "/" and (fs_type == "cgroup2"
                                or fs_type == "cgroup" and "memory" in options.split(",")):
                mounts[fs_type] = point
    with open("/proc/self/cgroup") as f:
        own = dict(line.rstrip("\n").split(":", 2)[1:] for line in f)  # controllers -> path
    parents = []  # (version, our cgroup's directory) where a child would get a memory limit
    if "cgroup2" in mounts and "" in own:
        parent = mounts["cgroup2"] + own[""]
        if "memory" in _read(f"{parent}/cgroup.subtree_control").split():
            parents.append((2, parent))
    parents += [(1, mounts["cgroup"] + path) for names, path in own.items()
                if "cgroup" in mounts and "memory" in names.split(",")]
    for version, parent in parents:
        child = f"{parent.rstrip('/')}/instar-sandbox-{secrets.token_hex(6)}"
        limit_file, swap_file, _ = _CGROUP_FILES[version]
        try:
            os.mkdir(child)
        except OSError:  # no permission
            continue
        try:
            _write(f"{child}/{limit_file}", limit)
            if os.path.exists(f"{child}/{swap_file}"):
                _write(f"{child}/{swap_file}", 0 if version == 2 else limit)
            return child, version
        except OSError:
            os.rmdir(child)
    return None


def _close_cgroup(path: str, version: int) -> bool:
    """Remove the cgroup once its processes are gone; whether the OOM killer acted in it."""
    events = _read(f"{path}/{_CGROUP_FILES[version][2]}").split()
    for _ in range(300):  # the processes of a killed sandbox take a moment to die
        try:
            os.rmdir(path)
            break
        except OSError:
            time.sleep(0.01)
    return "oom_kill" in events and events[events.index("oom_kill") + 1] != "0"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _write(path: str, value: int) -> None:
    with open(path, "w") as f:
        f.write(str(value))


# The launcher: runs as a script, stdlib only, in a process the caller can kill as a group.

_NEWNS, _NEWUTS, _NEWIPC = 0x20000, 0x4000000, 0x8000000
_NEWUSER, _NEWPID, _NEWNET = 0x10000000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT = 1, 2, 4, 32
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18
_PR_SET_DUMPABLE, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 4, 22, 38
# seccomp, where no memory cgroup can be made: per machine, the audit arch and the calls
# that make memory no address space counts (memfd_create, shmget)
_SECCOMP = {"x86_64": (0xC000003E, (319, 29)), "aarch64": (0xC00000B7, (279, 194))}


def _launch(tmp: str) -> None:
    import ctypes

    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    if cfg["cgroup"]:  # before anything else: every process of the sandbox is counted there
        with open(cfg["cgroup"] + "/cgroup.procs", "w") as f:
            f.write(str(os.getpid()))
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")

    as_root, uid, gid = os.geteuid() == 0, os.getuid(), os.getgid()
    flags = _NEWNS | _NEWUTS | _NEWIPC | _NEWPID | _NEWNET | (0 if as_root else _NEWUSER)
    check(libc.unshare(flags), "unshare")
    if not as_root:  # keep our ids in the new user namespace: exec drops its capabilities
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                           ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    if os.fork() == 0:  # pid 1 of the new pid namespace; the kernel kills the rest when it ends
        try:
            pid = _enter(cfg, tmp, as_root, libc, check)
        except BaseException:  # in pid 1, or in the code's process before its exec
            traceback.print_exc()
            os.write(cfg["ctl"], b"setup-failed ")
            os._exit(1)
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())  # e.g. SIGINT from it
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # not even a same-uid process may ptrace it
        status = os.waitpid(pid, 0)[1]
        words = f"exit:{os.waitstatus_to_exitcode(status)} "
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
            words += "cpu_time"  # SIGXCPU at RLIMIT_CPU's soft limit, SIGKILL at its hard one
        os.write(cfg["ctl"], words.encode())
        os._exit(0)
    os.wait()


def _enter(cfg: dict, new_root: str, as_root: bool, libc, check) -> int:
    """In pid 1: build the root and chroot; fork the code's process (which execs Python)."""
    import resource

    def bind(src: str, readonly: bool) -> None:
        dst = new_root + src
        check(libc.mount(src.encode(), dst.encode(), None, _MS_BIND, None), f"bind {src}")
        if readonly:  # a remount must keep the flags the source mount has locked
            kept = os.statvfs(src).f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC
                                             | os.ST_NOATIME | os.ST_NODIRATIME)
            flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | kept
            check(libc.mount(None, dst.encode(), None, flags, None), f"read-only {src}")

    files = {**cfg["files"], "main.py": cfg["code"]}
    size = (cfg["disk_mb"] << 20) + sum(len(text.encode(errors="replace")) + 8192
                                        for text in files.values())  # given files always fit
    options = f"size={size},mode=755".encode()
    check(libc.mount(b"tmpfs", new_root.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options),
          "tmpfs")
    for path in (*_SYSTEM, cfg["prefix"]):
        if os.path.islink(path):
            os.symlink(os.readlink(path), new_root + path)
        elif os.path.isdir(path) and not os.path.exists(new_root + path):  # not yet inside
            os.makedirs(new_root + path, exist_ok=True)
            bind(path, readonly=True)
    os.makedirs(new_root + "/dev")
    for name in ("null", "zero", "random", "urandom"):
        open(new_root + "/dev/" + name, "w").close()
        bind("/dev/" + name, readonly=False)
    stdin = os.memfd_create("stdin")
    os.write(stdin, cfg["stdin"].encode())
    os.lseek(stdin, 0, os.SEEK_SET)
    os.dup2(stdin, 0)
    os.mkdir(new_root + "/work")
    if pid := os.fork():
        os.chroot(new_root)
        return pid
    with open("/proc/self/oom_score_adj", "w") as f:  # the OOM killer takes the code first
        f.write("1000")
    os.chroot(new_root)
    os.chdir("/work")
    if as_root:  # root ignores RLIMIT_NPROC: run as a fresh uid that owns no other process
        uid = 60_000 + secrets.randbelow(5_000)
        os.chown("/work", uid, uid)
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    for name, text in files.items():
        os.makedirs(os.path.dirname(name) or ".", exist_ok=True)
        with open(name, "w", errors="replace") as f:
            f.write(text)
    cpu = math.ceil(cfg["cpu_s"])
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, (cfg["memory_mb"] << 20,) * 2),
                         (resource.RLIMIT_NPROC, (cfg["processes"],) * 2),
                         (resource.RLIMIT_FSIZE, (cfg["disk_mb"] << 20,) * 2),
                         (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)
    os.set_inheritable(cfg["ctl"], False)
    os.dup2(cfg["hints"], 3)
    check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")  # setuid bits do nothing
    if not cfg["cgroup"] and os.uname().machine in _SECCOMP:
        _deny_uncounted_memory(libc, check, *_SECCOMP[os.uname().machine])
    os.execve(cfg["python"], [cfg["python"], "-I", "-c", _GUARD], _ENV)


def _deny_uncounted_memory(libc, check, arch: int, calls: tuple[int, ...]) -> None:
    """A seccomp filter: `calls`, and every call of another ABI (i386, x32), fail with ENOMEM."""
    import ctypes
    import struct

    def op(code: int, k: int, jump_true: int = 0, jump_false: int = 0) -> bytes:
        return struct.pack("HBBI", code, jump_true, jump_false, k)

    n = len(calls)  # jumps count instructions skipped; the last instruction denies
    prog = [op(0x20, 4), op(0x15, arch, 0, n + 3),  # load the arch; not ours: deny
            op(0x20, 0), op(0x35, 0x4000_0000, n + 1),  # load the call; x32's bit set: deny
            *[op(0x15, nr, n - i) for i, nr in enumerate(calls)],  # a listed call: deny
            op(0x06, 0x7FFF_0000), op(0x06, 0x0005_0000 | 12)]  # allow; ERRNO(ENOMEM)
    code = ctypes.create_string_buffer(b"".join(prog))
    fprog = ctypes.create_string_buffer(struct.pack("HP", len(prog), ctypes.addressof(code)))
    check(libc.prctl(_PR_SET_SECCOMP, 2, fprog, 0, 0), "seccomp")  # 2: a filter


if __name__ == "__main__":
    _launch(sys.argv[1])
