"""The asynchronous loop survives what kills processes, as whole `instar rl` runs: an engine
killed mid-run is restarted and given the current weights while training goes on; a run
killed mid-step (driver, Ray and actors) resumes from its checkpoint (`--checkpoint.resume
auto`), is preempted (SIGTERM), saves a checkpoint at the end of its step, exits, and resumed
again it has trained on exactly the prompts, step by step, of the run that was never
interrupted, keeping only its newest checkpoint. Every run but the killed one leaves no
process and no /dev/shm folder behind. (Bounded staleness: tests/test_stream.py and
tests/test_rl_cli.py.)"""

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import step_lines

from instar.processes import marked

pytestmark = pytest.mark.stack

FLAGS = ["--train.warmup-sft-steps", "0", "--data.prompts-per-step", "3",
         "--rollout.group-size", "2", "--rollout.max-tokens", "12", "--rollout.preflight", "4",
         "--eval.size", "0", "--checkpoint.no-save-final", "--logging.no-progress",
         "--train.steps", "5", "--checkpoint.every", "2", "--checkpoint.keep", "1",
         "--rollout.max-staleness", "1"]


def start(root: Path, name: str, *flags) -> subprocess.Popen:
    """`instar rl` into root/name; every process it starts carries INSTAR_TEST_TAG=proc.tag."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "instar.cli", "rl", *FLAGS, *flags,
                             "--logging.root", str(root), "--logging.name", name],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "INSTAR_TEST_TAG": tag})
    proc.tag = tag
    return proc


def finish(proc: subprocess.Popen, returncode=0, timeout=900) -> str:
    """Its output, once it exited with `returncode`, leaving no process and no /dev/shm folder."""
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == returncode, out[-4000:]
    assert marked("INSTAR_TEST_TAG", proc.tag) == []
    assert glob.glob(f"/dev/shm/instar-{proc.pid}-*") == []
    return out


def wait_for(proc: subprocess.Popen, done, what: str, timeout=600) -> None:
    deadline = time.time() + timeout
    while not done():
        assert proc.poll() is None and time.time() < deadline, f"the run ended before {what}"
        time.sleep(0.2)


def test_an_engine_killed_mid_run_and_a_run_killed_or_preempted_change_no_prompt(tmp_path):
    # the whole run, whose engine is killed after step 2: Ray restarts it, the router gives it
    # the current weights, its episodes start again, and the run goes on
    whole = start(tmp_path, "whole")
    metrics_file = tmp_path / "whole" / "metrics.jsonl"
    wait_for(whole, lambda: metrics_file.exists() and len(step_lines(tmp_path / "whole")) >= 2,
             "step 2")
    engines = [p for p in psutil.Process(whole.pid).children(recursive=True)
               if "ray::Engine" in " ".join(p.cmdline())]
    assert len(engines) == 1
    os.kill(engines[0].pid, signal.SIGKILL)
    # meanwhile, the same run killed whole (driver, Ray and its actors) in step 3: a SIGKILL
    # leaves its /dev/shm folder, which the next command does not know of
    cut = start(tmp_path, "cut")
    checkpoints = tmp_path / "cut" / "checkpoints"
    wait_for(cut, lambda: (checkpoints / "latest").exists() and
             (checkpoints / "latest").read_text().strip().endswith("2"), "its checkpoint of step 2")
    family = psutil.Process(cut.pid).children(recursive=True)
    os.killpg(cut.pid, signal.SIGKILL)
    for p in family:
        if p.is_running():
            p.kill()
    cut.wait()
    for folder in glob.glob(f"/dev/shm/instar-{cut.pid}-*"):
        shutil.rmtree(folder)
    finish(whole)

    # resumed, then preempted once it has logged a step: it checkpoints that step's successor
    # (the step in progress) and exits; resumed again, it finishes
    lines = tmp_path / "cut" / "metrics.jsonl"
    logged = len(lines.read_text().splitlines())
    preempted = start(tmp_path, "cut", "--checkpoint.resume", "auto")
    wait_for(preempted, lambda: len(lines.read_text().splitlines()) > logged, "a step")
    preempted.send_signal(signal.SIGTERM)
    out = finish(preempted, 128 + signal.SIGTERM)
    saved = int((checkpoints / "latest").read_text().strip().removeprefix("step-"))
    assert saved == max(step_lines(tmp_path / "cut")) and f"checkpoint of step {saved}" in out
    finish(start(tmp_path, "cut", "--checkpoint.resume", "auto"))

    metrics = step_lines(tmp_path / "whole")
    assert sorted(metrics) == [1, 2, 3, 4, 5]
    assert metrics[1]["engine/0/restarted"] == 0 and metrics[5]["engine/0/restarted"] == 1
    # the restarted engine got the current weights: the probe check passed after every sync
    # and the lag-0 tokens' log-probs match the trainer's
    assert all(m["invariants/sync_probe_diff"] < 1e-4 for m in metrics.values())
    assert all(m.get("invariants/abs_logprob_diff", 0.0) < 1e-4 for m in metrics.values())
    resumed = step_lines(tmp_path / "cut")
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert [resumed[s]["prompts"] for s in resumed] == [metrics[s]["prompts"] for s in metrics]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", f"step-{max(saved, 4):08d}"]
    summary = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert summary["reward_last_step"] == resumed[5]["rollout/reward"]
