"""Every process a command starts ends with it, however the command ends (normally, Ctrl-C,
SIGTERM or an exception).

    with command():     # instar/cli.py, around every command
        ...             # Ray, its workers, vLLM's EngineCore, agents' tools: all marked

  mark     INSTAR_COMMAND=<pid>-<random> goes into os.environ before anything starts; Ray's
           GCS, raylet and workers inherit it, and so do their children.
  SIGTERM  (how Slurm preempts) raises Preempted in the main thread: the command unwinds as
           on Ctrl-C, every `finally` runs. `instar rl` defers it to the end of the step
           (`deferred_sigterm`) to save a checkpoint first.
  exit     after the command's own shut-down, whatever still carries the mark gets SIGTERM,
           then SIGKILL; the command's folders in /dev/shm (`scratch_dir`) are removed.

A Ray that was up before the command (the tests', a notebook's, a cluster joined with
--cluster.ray-address) lacks the mark and is left alone; Ray ends the command's actors there.
A SIGKILL of the command runs none of this: Ray's processes end on their own within seconds,
the folder /dev/shm/instar-<pid>-* stays.
"""

import glob
import os
import secrets
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psutil

MARK = "INSTAR_COMMAND"
SHM = "/dev/shm"


class Preempted(KeyboardInterrupt):
    """SIGTERM arrived: the command stops as on Ctrl-C (`except Exception` lets it through)."""


def _preempt(signum, frame):
    raise Preempted("stopped by SIGTERM")


def on_sigterm(handler=_preempt):
    """Handle SIGTERM with `handler` (by default: raise Preempted); the previous handler, or
    None off the main thread, where Python cannot handle signals."""
    if threading.current_thread() is threading.main_thread():
        return signal.signal(signal.SIGTERM, handler)
    return None


@contextmanager
def deferred_sigterm() -> Iterator[Callable[[], bool]]:
    """Within: a SIGTERM only sets the flag that the yielded function reads, for the caller to
    stop where it can stop cleanly; a second SIGTERM raises Preempted at once."""
    got = threading.Event()

    def defer(signum, frame):
        got.set()
        on_sigterm()

    previous = on_sigterm(defer)
    try:
        yield got.is_set
    finally:
        if previous is not None:
            on_sigterm(previous)


def marked(name: str, value: str) -> list[psutil.Process]:
    """The processes (but this one) whose environment has name=value."""
    return [p for p in psutil.process_iter(["environ"])
            if (p.info["environ"] or {}).get(name) == value and p.pid != os.getpid()]


def end(procs: list[psutil.Process], grace: float = 3.0) -> None:
    """SIGTERM, then SIGKILL to those still running after `grace` seconds."""
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    for p in psutil.wait_procs(procs, timeout=grace)[1]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def scratch_dir() -> str:
    """A new folder for files shared through memory (in /dev/shm where there is one), named
    after the command, which removes it when it ends."""
    mark = os.environ.get(MARK)
    return tempfile.mkdtemp(prefix=f"instar-{mark}-" if mark else "instar-",
                            dir=SHM if os.path.isdir(SHM) else None)


@contextmanager
def command() -> Iterator[str]:
    """Mark what the command starts; SIGTERM raises Preempted; on exit end whatever still
    carries the mark and remove the command's /dev/shm folders. Yields the mark."""
    mark, outer = f"{os.getpid()}-{secrets.token_hex(4)}", os.environ.get(MARK)
    os.environ[MARK] = mark
    previous = on_sigterm()
    try:
        yield mark
    finally:
        on_sigterm(signal.SIG_IGN)  # the clean-up runs to its end
        end(marked(MARK, mark))
        for path in glob.glob(f"{SHM}/instar-{mark}-*"):
            shutil.rmtree(path, ignore_errors=True)
        if outer is None:
            os.environ.pop(MARK)
        else:
            os.environ[MARK] = outer
        if previous is not None:
            on_sigterm(previous)
