"""A trainer rank's step without Ray: the code every rank runs, under `torchrun` with two
processes, in an environment where `import ray` (and vllm) fails."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.stack

HIDE = """import importlib.abc, sys
class Hidden(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("ray", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")
sys.meta_path.insert(0, Hidden())
"""

STEP = """import json, sys
import torch.distributed as dist
from instar.config import AlgoConfig
from instar.train.batch import Sequence, shard
from instar.train.rank import Rank, join

join("cpu")
rank = Rank(sys.argv[1], lr=1e-2)
seqs = [Sequence(list(range(3 + k, 19 + k)), [False] * 4 + [True] * 12, [0.0] * 16)
        for k in range(8)]
mine = shard(seqs, dist.get_world_size(), 10_000)[dist.get_rank()]
losses = [rank.train_step(mine, "sft", AlgoConfig(), 8 * 12, 8, 1.0, 1e-2, 1.0) for _ in range(4)]
out = dict(rank=dist.get_rank(), world=dist.get_world_size(), ray="ray" in sys.modules,
           losses=[x["loss"] for x in losses], norms=[x["grad_norm"] for x in losses])
open(f"{sys.argv[2]}/rank-{dist.get_rank()}.json", "w").write(json.dumps(out))
rank.shutdown()
"""


def test_a_rank_steps_under_torchrun_without_ray(tiny_model, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    (tmp_path / "step.py").write_text(STEP)
    hidden = subprocess.run([sys.executable, "-c", "import ray"], capture_output=True, text=True,
                            env={"PYTHONPATH": str(tmp_path)})
    assert "hidden by the test" in hidden.stderr  # the hiding works
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(tmp_path / "step.py"), str(tiny_model),
                          str(tmp_path)],
                         capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1",
                              "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"], r["ray"]) for r in results] == [(0, 2, False), (1, 2, False)]
    # the ranks' shares add up to one loss, which falls; the gradient norm is global
    totals = [a + b for a, b in zip(results[0]["losses"], results[1]["losses"])]
    assert totals[-1] < totals[0]
    assert results[0]["norms"] == pytest.approx(results[1]["norms"])
