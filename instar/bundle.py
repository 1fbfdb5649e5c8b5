"""Replay bundles: everything one RL step's update needs, written by `instar rl` every
`--logging.bundle-every` steps and recomputed by `instar replay` (instar/replay.py) on a CPU.

    runs/RUN/bundles/step-00000010/
      bundle.json     schema, step, kl_coef, the trainer's rank count, the policy's starting
                      checkpoint (an HF folder: architecture and frozen weights), the outcome
                      (the step's train/ stats: loss, grad norm, ...); written last
      config.yaml     the run's resolved config (seed: the shuffle of `learn` is seeded by it
                      and the step)
      samples.jsonl   the step's trained samples, as `learn` received them
      before/         trainer checkpoint of the weights step k started from: trained weights,
                      AdamW state, each rank's RNG (instar/train/checkpoint.py; DCP, so it loads
                      on any rank count); before/critic/ with gae. None before the first update
                      (the optimizer is fresh: the weights are the starting checkpoint's, and
                      saving would start AdamW's state, changing the run)
      after/          the same after the step's update: what a replay is compared with

The weights live in the bundle, not in checkpoints/, so `--checkpoint.keep` never removes a
checkpoint a bundle needs; each bundle costs two checkpoints of disk. A reference or teacher
is a frozen model named in config.yaml (or the starting checkpoint), read from there.
"""

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from instar.config import Config, load_yaml
from instar.sample import Sample, read_jsonl, write_jsonl
from instar.train.checkpoint import latest

SCHEMA = 1
"""The bundle layout's version; `read` refuses others."""


@dataclass
class Bundle:
    """A bundle as read back (see the module docstring)."""

    folder: Path
    meta: dict
    """bundle.json."""
    cfg: Config
    samples: list[Sample]


def begin(r, step: int) -> dict | None:
    """At the start of step `step`'s update, if it is a bundle step: save the weights it starts
    from. `r`: the loop's Run. The bundle so far (`end` completes it), or None."""
    every = r.cfg.logging.bundle_every
    if not every or step % every:
        return None
    shutil.rmtree(folder(r, step), ignore_errors=True)  # (a resumed run redoes the step)
    if any("train/loss" in m for m in r.history):  # (else AdamW is fresh: see above)
        save(r, folder(r, step) / "before", step - 1)
    return {"schema": SCHEMA, "step": step, "kl_coef": r.kl_coef}


def end(bundle: dict | None, r, samples: list[Sample], stats: dict) -> None:
    """After the update: its weights, the samples, the config and bundle.json."""
    if bundle is None:
        return
    out = folder(r, bundle["step"])
    save(r, out / "after", bundle["step"])
    write_jsonl(out / "samples.jsonl", samples)
    (out / "config.yaml").write_text(r.cfg.to_yaml())
    meta = {**bundle, "ranks": r.cfg.train.num_ranks, "model": str(r.model), "outcome": stats}
    (out / "bundle.json").write_text(json.dumps(meta, indent=1))


def folder(r, step: int) -> Path:
    return r.dir / "bundles" / f"step-{step:08d}"


def save(r, folder: Path, step: int) -> None:
    """The trainer's checkpoint (and the critic's, in folder/critic) into `folder`."""
    if "critic" in r.others:
        r.others["critic"].save_checkpoint(folder / "critic", step, {}, 1)
    r.trainer.save_checkpoint(folder, step, {}, 1)


def read(path: str) -> Bundle:
    """The bundle in folder `path`; a ValueError naming what is wrong."""
    folder = Path(path)
    if not (folder / "bundle.json").is_file():
        raise ValueError(f"{path}: not a replay bundle (no bundle.json; bundles are "
                         "runs/RUN/bundles/step-N, written with --logging.bundle-every)")
    try:
        meta = json.loads((folder / "bundle.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: bundle.json is not JSON ({e})") from e
    schema = meta.get("schema") if isinstance(meta, dict) else None
    if schema != SCHEMA:
        raise ValueError(f"{path}: bundle schema {schema!r}; this instar reads schema {SCHEMA}")
    if not Path(meta["model"]).is_dir():
        raise ValueError(f"{path}: the run's starting checkpoint {meta['model']} is gone")
    if latest(folder / "after") is None:
        raise ValueError(f"{path}: after/, the weights the step gave, is missing")
    return Bundle(folder, meta, load_yaml(str(folder / "config.yaml")),
                  read_jsonl(folder / "samples.jsonl"))
