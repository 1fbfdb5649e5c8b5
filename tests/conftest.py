"""Shared fixtures: the built-in tiny model, one Ray session and one engine for all tests."""

from pathlib import Path

import pytest

from instar.tasks.tools import CALCULATOR


@pytest.fixture(scope="session")
def tiny_model():
    from instar.tasks.tiny_model import builtin_model

    return builtin_model("dense", "tiny", 0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def serve_model(path, max_model_len: int = 512):
    """One CPU engine on `path` (a generator for a fixture); stopped after its last test."""
    from instar.rollout.engine import launch, stop_engines

    (actor,) = launch(str(path), device="cpu", dtype="float32", max_model_len=max_model_len,
                      kv_cache_gb=1, threads=1, seed=0)
    yield actor
    stop_engines([actor])


@pytest.fixture(scope="session")
def engines(ray_session, tiny_model):
    """Two engines on the tiny model for the whole session (each start costs ~30 s here):
    `engine` is the first; the router and partial-rollout tests use both, and put back the
    base weights, version 0 and partial rollout when they are done."""
    from instar.rollout.engine import launch, stop_engines

    pair = launch(str(tiny_model), device="cpu", dtype="float32", max_model_len=1024,
                  kv_cache_gb=1, threads=1, seed=0, count=2)
    yield pair
    stop_engines(pair)


@pytest.fixture(scope="session")
def engine(engines):
    return engines[0]


def restore(engine, tiny_model) -> None:
    """Put `engine` back as the session started it: base weights, version 0, partial rollout."""
    import ray

    ray.get(engine.__ray_call__.remote(lambda e: setattr(e, "partial", True)))
    ray.get(engine.load_weights.remote([str(tiny_model / "model.safetensors")], 0))


TOOL_CONVERSATION = [
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                      "arguments": {"expression": "2+3"}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "The answer is 5."},
]


class OneRank:
    """The trainer's `step` over one FSDP2 rank in this process (a group of one)."""

    def __init__(self, rank):
        self.rank = rank

    def step(self, seqs, loss: str, lr: float) -> dict:
        from instar.config import AlgoConfig

        return self.rank.train_step([seqs], loss, AlgoConfig(), sum(sum(s.mask) for s in seqs),
                                    len(seqs), 1.0, lr, 0.0)


def teach(base: Path, out: Path, conversations: list[list[dict]], tools: list[dict] | None,
          steps: int = 250, batch: int = 0) -> Path:
    """`base` after a few seconds of SFT on the assistant turns of `conversations` (a model
    that reliably says what it was taught), written to `out` as a Hugging Face folder. The
    same supervised steps as `instar sft` and the warm-up, on one rank in this process;
    `batch` conversations a step (0: all)."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from instar.train.checkpoint import export_hf
    from instar.train.rank import Rank, join
    from instar.train.sft import image_processor, supervised

    join("cpu")
    try:
        one = OneRank(Rank(str(base), threads=2, lr=3e-3))
        rows = [{"messages": c, "tools": tools} for c in conversations]
        for _ in supervised(one, AutoTokenizer.from_pretrained(base), rows, steps,
                            batch or len(rows), lambda _: 3e-3, seed=0,
                            images=image_processor(base)):
            pass
        export_hf(base, out, one.rank.save_weights)
    finally:
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="session")
def tool_model(tiny_model, tmp_path_factory):
    """The tiny model taught (a few seconds of SFT) to call the calculator and then answer, so
    that real engine generations contain tool calls (instar/tasks/tools.py)."""
    return teach(tiny_model, tmp_path_factory.mktemp("tool_model"), [TOOL_CONVERSATION],
                 [CALCULATOR])


@pytest.fixture(scope="session")
def tool_engine(ray_session, tool_model):
    yield from serve_model(tool_model)


def instar(root: Path, command: str, *flags: str, name: str = "run") -> Path:
    """`instar COMMAND FLAGS` in this process, on the tests' Ray (a test using it asks for the
    `ray_session` fixture), into the run directory root/name, which it returns."""
    from instar.cli import main

    main([command, *flags, "--logging.root", str(root), "--logging.name", name,
          "--logging.no-progress"])
    return root / name


def step_lines(run: Path) -> dict[int, dict]:
    """The step lines of a run's metrics.jsonl (eval lines left out), by step; a step logged
    twice (it ran again after a resume) counts by its last line."""
    import json

    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m for m in lines if "rollout/reward" in m}
