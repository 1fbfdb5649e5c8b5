"""The benchmark harness runs against the current loop: benchmarks/gpu_bench.py --smoke (the
GPU script's code on CPU, tiny shapes: dense and MoE) and its figures hang together. Timings
are not checked here; the benchmarks themselves measure them."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.stack


def test_gpu_bench_smoke_runs_dense_and_moe_and_writes_its_figures(tmp_path):
    out = tmp_path / "gpu_bench.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_bench.py", "--smoke", "--only", "grpo", "moe",
         "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["smoke"] and result["peak_gflops"] > 0
    assert sorted(result["runs"]) == ["grpo", "moe"]
    for name, r in result["runs"].items():
        (step,) = r["per_step"]  # --smoke: one measured step after the warm-up step
        assert step["episodes"] == 4 and 0 < r["gen_tokens_per_episode"] <= 64, name
        assert r["trained_tokens_per_gpu_s"] > r["gen_tokens_per_gpu_s"] > 0, name
        assert 0 < r["mfu_train"] < 1, name
        split = r["time_split"]
        assert min(split.values()) >= 0, name
        assert abs(sum(split.values()) - r["step_s"]["median"]) < 1e-6, name  # it covers the step
    assert result["runs"]["moe"]["model"] == "qwen3-moe"
