"""A command leaves nothing behind, however it ends. Fast: a small process tree under
`command()` (instar/processes.py) is ended with it, normally, by an exception, Ctrl-C or
SIGTERM, and its /dev/shm folder removed, while what ran before it is left alone. On the
stack: a run that fails mid-step stops with a clear message and leaves no weights folder in
/dev/shm, no Ray actor, no engine or rank process; the agent, the engine and the trainer each
fail in turn, in step 2 of a run inside this process (on the tests' Ray, which lives on)."""

import glob
import os
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
import ray
import ray._private.state

import instar.rollout.router
import instar.train.trainer
from instar.config import Config
from instar.loop import run
from instar.processes import MARK, command, marked

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]

CHILD = f"""
import signal, subprocess, sys, time
if sys.argv[1] == "SIGTERM":  # as a stuck process: it takes a SIGKILL
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen({SLEEP!r})
print(flush=True)
time.sleep(600)
"""

DRIVER = f"""
import os, signal, subprocess, sys, time
from instar.processes import command, scratch_dir

signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored if started in the background)

with command():
    open(os.path.join(scratch_dir(), "weights"), "w").close()
    # a child with a grandchild, which is orphaned when the child is killed
    child = subprocess.Popen([sys.executable, "-c", {CHILD!r}, sys.argv[1]], stdout=subprocess.PIPE)
    child.stdout.readline()
    print("started", flush=True)
    if sys.argv[1] == "exception":
        raise RuntimeError("the command broke")
    if sys.argv[1] != "normal":
        time.sleep(600)
"""


@pytest.mark.parametrize("ending", ["normal", "exception", "SIGINT", "SIGTERM"])
def test_a_command_ends_every_process_it_started_and_its_shm_folder(ending):
    tag = uuid.uuid4().hex  # the test's own mark, to find the command's processes from outside
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, ending], text=True,
                            env={**os.environ, "INSTAR_TEST_TAG": tag}, stdout=subprocess.PIPE)
    assert proc.stdout.readline() == "started\n"
    if ending.startswith("SIG"):
        assert len(marked("INSTAR_TEST_TAG", tag)) == 3  # the driver, child and grandchild
        proc.send_signal(getattr(signal, ending))
    assert (proc.wait(timeout=60) == 0) == (ending == "normal")
    assert marked("INSTAR_TEST_TAG", tag) == []
    assert glob.glob(f"/dev/shm/instar-{proc.pid}-*") == []


def test_a_command_leaves_alone_what_it_did_not_start():
    before = subprocess.Popen(SLEEP)  # as the tests' Ray: started before the command
    try:
        with command():
            inside = subprocess.Popen(SLEEP)
        assert inside.wait(timeout=30) is not None and before.poll() is None
        assert MARK not in os.environ
    finally:
        before.kill()


AGENT = '''
from instar import Env, Result

STARTED = [0]


class Breaks(Env):
    """Episodes 1-4 (step 1) work; from the fifth on, the agent raises."""

    async def reset(self, task):
        STARTED[0] += 1
        self.n = STARTED[0]
        return task.prompt

    async def step(self, action):
        if self.n > 4:
            raise RuntimeError("the agent broke")
        return Result(reward=float(len(action.text) % 2))


AgentRunner = Breaks
'''


def config(tmp_path, agent: str = "") -> Config:
    cfg = Config()
    cfg.agent.file, cfg.data.task = agent, "reverse"
    cfg.train.steps, cfg.train.warmup_sft_steps, cfg.train.num_ranks = 3, 0, 1
    cfg.data.prompts_per_step, cfg.rollout.group_size, cfg.rollout.max_tokens = 2, 2, 8
    cfg.rollout.max_staleness, cfg.rollout.preflight, cfg.eval.size = 0, 0, 0
    cfg.checkpoint.save_final = False
    cfg.logging.progress = cfg.logging.plots = cfg.logging.tensorboard = False
    cfg.logging.root, cfg.logging.name = str(tmp_path), "run"
    return cfg


def after_calls(n: int, original, change):
    """`original`, with its arguments changed by `change` from the (n+1)-th call on."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        return original(*(change(args) if calls[0] > n else args), **kwargs)
    return wrapped


def leftovers() -> tuple:
    """Weight folders in /dev/shm, live actors, engine and rank processes, CPUs held by
    placement groups."""
    actors = {k for k, a in ray._private.state.actors().items() if a["State"] != "DEAD"}
    procs = set()  # (this process started the tests' Ray: its workers descend from here)
    for p in psutil.Process().children(recursive=True):
        try:
            if p.cmdline()[:1] and p.cmdline()[0].startswith(("ray::Engine", "ray::TrainWorker")):
                procs.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    held = ray.cluster_resources()["CPU"] - ray.available_resources().get("CPU", 0)
    return set(glob.glob("/dev/shm/instar-*")), actors, procs, held


@pytest.mark.stack
@pytest.mark.parametrize("part", ["agent", "engine", "trainer"])
def test_a_failing_step_stops_the_run_and_leaves_nothing(part, ray_session, tmp_path,
                                                         monkeypatch):
    cfg = config(tmp_path)
    if part == "agent":
        (tmp_path / "agent.py").write_text(AGENT)
        cfg.agent.file, expected = str(tmp_path / "agent.py"), "step 2: every rollout failed"
    elif part == "engine":  # from step 2 on, requests the engine raises on (vLLM's own check)
        bad = lambda a: (*a[:3], {**a[3], "temperature": -1.0}, *a[4:])  # noqa: E731
        monkeypatch.setattr(instar.rollout.router.Router, "generate",
                            after_calls(4, instar.rollout.router.Router.generate, bad))
        expected = "temperature must be non-negative"
    else:  # the second update asks the ranks for a loss they do not have
        bad = lambda a: (a[0], a[1], "no-such-loss", *a[3:])  # noqa: E731
        monkeypatch.setattr(instar.train.trainer.Trainer, "step",
                            after_calls(1, instar.train.trainer.Trainer.step, bad))
        expected = "unknown loss 'no-such-loss'"
    before = leftovers()
    with pytest.raises(Exception, match=expected), command():
        run(cfg)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1  # step 1 ran and was logged; step 2 failed
    deadline = time.time() + 60  # (actors end asynchronously once killed)
    while leftovers() != before and time.time() < deadline:
        time.sleep(0.5)
    assert leftovers() == before
