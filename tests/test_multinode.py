"""A real two-node Ray cluster on this machine: a head with the custom resource `node_a` and a
second `ray start` with `node_b` (stopped at the end with all their processes, by pid, even
on failure; `ray stop` would stop every Ray on the machine). `instar rl` joins it with
--cluster.ray-address and puts the engine on node_a, both trainer ranks and the agent runner on
node_b; Ray's actor table must say so, and the run must end with its normal summary.

Ray resolves 127.0.0.1 to the machine's own address, so both nodes share one IP: the
placement and the rendezvous go through Ray exactly as across hosts, the network does not.
"""

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.stack
RAY = str(Path(sys.executable).parent / "ray")

QUERY = """
import json, sys, time, ray
import ray._private.state as state  # the GCS actor table: the state API needs Ray's dashboard
ray.init(address=sys.argv[1], log_to_driver=False)
deadline = time.time() + 120
while sum(n["Alive"] for n in ray.nodes()) < int(sys.argv[2]) and time.time() < deadline:
    time.sleep(1)
print(json.dumps({
    "nodes": {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]},
    "actors": [{"class": a["ActorClassName"], "node": a["Address"]["NodeID"],
                "job": a["JobID"]} for a in state.actors().values()]}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def query(address: str, env: dict, nodes: int) -> dict:
    """Ray's view of the cluster (alive nodes and every actor so far), once `nodes` are up."""
    out = subprocess.run([sys.executable, "-c", QUERY, address, str(nodes)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `proc` (a drained Ray node stops its own processes), then SIGKILL whatever of
    its process tree is left: by pid, since Ray gives each worker a process group of its own."""
    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    proc.terminate()
    for p in psutil.wait_procs(tree, timeout=grace_s)[1]:
        p.kill()
    proc.wait()


@pytest.fixture
def cluster():
    """(address, env) of a running two-node cluster; env has its (fresh) auth token."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Unix socket paths go under it
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               RAY_USAGE_STATS_ENABLED="0")
    common = ["--block", f"--temp-dir={temp}", "--node-ip-address=127.0.0.1",
              "--object-store-memory=100000000", "--disable-usage-stats"]
    nodes = [  # fixed default ports would clash between the two nodes or with other Rays
        ["--head", f"--port={port}", f"--ray-client-server-port={free_port()}",
         f"--dashboard-port={free_port()}", "--include-dashboard=false", "--num-cpus=1",
         '--resources={"node_a": 1}'],
        [f"--address=127.0.0.1:{port}", "--num-cpus=2", '--resources={"node_b": 3}'],
    ]
    procs = []
    try:
        for i, flags in enumerate(nodes):
            with open(f"{temp}/node{i}.log", "w") as log:  # cwd: not the run's directory
                agent = f"--dashboard-agent-listen-port={free_port()}"
                procs.append(subprocess.Popen([RAY, "start", *flags, agent, *common], env=env,
                                              cwd=temp, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            deadline = time.time() + 60
            while i == 0 and not listening(port):
                assert procs[0].poll() is None and time.time() < deadline, \
                    Path(f"{temp}/node0.log").read_text()[-3000:]
                time.sleep(0.5)
        yield f"127.0.0.1:{port}", env
    finally:
        for proc in reversed(procs):
            stop(proc, grace_s=15)
        shutil.rmtree(temp, ignore_errors=True)


def test_engine_and_ranks_on_different_nodes(cluster, tmp_path):
    address, env = cluster
    before = query(address, env, nodes=2)
    assert len(before["nodes"]) == 2
    node_a, = [n for n, res in before["nodes"].items() if "node_a" in res]
    node_b, = [n for n, res in before["nodes"].items() if "node_b" in res]

    cmd = [sys.executable, "-m", "instar.cli", "rl", "--data.task", "reverse",
           "--cluster.ray-address", address,
           "--rollout.placement", "disaggregated", "--cluster.engine-resource", "node_a",
           "--cluster.trainer-resource", "node_b", "--rollout.threads", "1",
           "--rollout.runners", "1", "--cluster.runner-resource", "node_b",
           "--train.num-ranks", "2", "--train.steps", "2", "--train.warmup-sft-steps", "0",
           "--data.prompts-per-step", "2", "--rollout.group-size", "2", "--eval.size", "2",
           "--rollout.max-tokens", "8", "--logging.root", "runs", "--logging.name", "two-nodes",
           "--logging.no-progress"]
    run = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = run.communicate(timeout=900)
    finally:
        if run.poll() is None:
            stop(run, grace_s=5)
    assert run.returncode == 0, (out + err)[-5000:]
    assert "instar rl: summary" in out
    run_dir = tmp_path / "runs" / "two-nodes"  # relative to the run's cwd, not the workers' cwd
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "eval_reward_after" in summary and "reward_last_step" in summary
    assert (run_dir / "final" / "model.safetensors").is_file()  # written by rank 0

    after = query(address, env, nodes=2)
    placed = {}
    for actor in after["actors"]:
        placed.setdefault(actor["class"], []).append(actor["node"])
    assert placed["Engine"] == [node_a]
    assert placed["TrainWorker"] == [node_b, node_b]
    assert placed["Runner"] == [node_b]  # the episodes ran there, on the engine of node_a
