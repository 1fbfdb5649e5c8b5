"""A run's log: metrics.jsonl (one line a step or eval), TensorBoard event files, and W&B
when a project is configured. Each JSONL line carries `time` (Unix seconds, when it was
written). Non-numeric values (lists of prompt ids) go to the JSONL only."""

import json
import time
from pathlib import Path


class RunLog:
    def __init__(self, run_dir: Path, config: dict, *, resume: bool, tensorboard: bool,
                 wandb_project: str):
        self.file = open(run_dir / "metrics.jsonl", "a" if resume else "w")
        self.tb = self.wandb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("--logging.wandb-project needs wandb: pip install wandb") from e
            self.wandb = wandb.init(project=wandb_project, name=run_dir.name, config=config,
                                    dir=str(run_dir), resume="allow")

    def log(self, m: dict, step: int) -> None:
        self.file.write(json.dumps({**m, "time": round(time.time(), 3)}) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in m.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
