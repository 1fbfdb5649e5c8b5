"""The benchmark harness runs against the current loop: benchmarks/gpu_bench.py --smoke (the
GPU script's code on CPU, tiny shapes) and its figures hang together, in this process on the
tests' Ray. The dense workload only: the MoE one runs the same code on another model, and
`instar rl` on a MoE model is tested in tests/test_rl_cli.py. Timings are not checked here;
the benchmarks themselves measure them."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack


def test_gpu_bench_smoke_runs_and_writes_its_figures(ray_session, tmp_path):
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import gpu_bench
    finally:
        sys.path.pop(0)
    out = tmp_path / "gpu_bench.json"
    gpu_bench.main(["--smoke", "--only", "grpo", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["smoke"] and result["peak_gflops"] > 0
    (r,) = result["runs"].values()
    (step,) = r["per_step"]  # --smoke: one measured step after the warm-up step
    assert step["episodes"] == 4 and 0 < r["gen_tokens_per_episode"] <= 64
    assert r["trained_tokens_per_gpu_s"] > r["gen_tokens_per_gpu_s"] > 0
    assert 0 < r["mfu_train"] < 1
    split = r["time_split"]
    assert min(split.values()) >= 0
    assert abs(sum(split.values()) - r["step_s"]["median"]) < 1e-6  # it covers the step
    assert r["model"] == "qwen3-0.6b"
