"""`instar serve` as a user runs it: URLs and key printed, a request answered, sessions saved
to the run directory on Ctrl-C or SIGTERM, and no process of the command left running."""

import glob
import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest

from instar.processes import marked
from instar.sample import read_jsonl

pytestmark = pytest.mark.stack


def serve(tmp_path, tiny_model, name: str) -> subprocess.Popen:
    """`instar serve` into tmp_path/name; its processes carry INSTAR_TEST_TAG=that folder."""
    env = {**os.environ, "INSTAR_TEST_TAG": str(tmp_path / name)}
    return subprocess.Popen(
        [sys.executable, "-m", "instar.cli", "serve", "--model.path", str(tiny_model),
         "--rollout.max-tokens", "8", "--rollout.max-model-len", "512",
         "--logging.root", str(tmp_path), "--logging.name", name],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)


def test_instar_serve_prints_urls_and_writes_sessions(tiny_model, tmp_path):
    """Two at once (their start-ups overlap): one stopped by Ctrl-C, one by SIGTERM."""
    procs = {stop: serve(tmp_path, tiny_model, stop) for stop in ("SIGINT", "SIGTERM")}
    try:
        for stop, proc in procs.items():
            lines, deadline = [], time.time() + 300
            while not any("Anthropic base URL" in line for line in lines):
                assert time.time() < deadline and proc.poll() is None, lines
                lines.append(proc.stdout.readline())
            text = "".join(lines)
            key = re.search(r"api key: (\S+)", text).group(1)
            base = re.search(r"OpenAI base URL:\s+(\S+)", text).group(1)
            assert base.startswith("http://127.0.0.1:") and base.endswith("/v1")
            reply = openai.OpenAI(base_url=base, api_key=key).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}])
            assert reply.usage.completion_tokens == 8
            proc.send_signal(getattr(signal, stop))
        for proc in procs.values():
            assert proc.wait(timeout=120) == 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
    for stop, proc in procs.items():
        assert marked("INSTAR_TEST_TAG", str(tmp_path / stop)) == []
        assert glob.glob(f"/dev/shm/instar-{proc.pid}-*") == []
        samples = read_jsonl(tmp_path / stop / "sessions.jsonl")
        assert len(samples) == 1 and samples[0].num_generated == 8
