"""The asynchronous loop survives what stops processes, as whole `instar rl` runs: an engine
killed mid-run is restarted and given the current weights while training goes on; a run
preempted mid-run (SIGTERM, as Slurm does) saves a checkpoint at the end of its step and
exits, and resumed (`--checkpoint.resume auto`) it has trained on exactly the prompts, step
by step, of the run that was never interrupted, keeping only its newest checkpoint. No run
leaves a process or a /dev/shm folder behind. (A checkpoint a crash cut short, and exact
resume from the one before: tests/test_checkpoint.py. Bounded staleness: tests/test_stream.py
and tests/test_rl_cli.py.)"""

import glob
import json
import os
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

FLAGS = ["--data.task", "reverse", "--train.warmup-sft-steps", "0", "--data.prompts-per-step", "3",
         "--rollout.group-size", "2", "--rollout.max-tokens", "12", "--rollout.preflight", "4",
         "--eval.size", "0", "--checkpoint.no-save-final", "--logging.no-progress",
         "--train.steps", "5", "--checkpoint.every", "2", "--checkpoint.keep", "1",
         "--rollout.schedule", "overlap", "--rollout.max-staleness", "1"]


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


def test_an_engine_killed_mid_run_and_a_preempted_run_change_no_prompt(tmp_path):
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
    # meanwhile, the same run preempted once it has logged step 2: it checkpoints the step in
    # progress and exits; resumed, it finishes
    cut = start(tmp_path, "cut")
    lines, checkpoints = tmp_path / "cut" / "metrics.jsonl", tmp_path / "cut" / "checkpoints"
    wait_for(cut, lambda: lines.exists() and len(step_lines(tmp_path / "cut")) >= 2, "step 2")
    cut.send_signal(signal.SIGTERM)
    out = finish(cut, 128 + signal.SIGTERM)
    saved = int((checkpoints / "latest").read_text().strip().removeprefix("step-"))
    assert saved == max(step_lines(tmp_path / "cut")) < 5 and f"checkpoint of step {saved}" in out
    finish(whole)
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
