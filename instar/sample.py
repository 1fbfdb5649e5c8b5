"""The token-first sample: everything between rollout and loss is one of these records.

    prompt tokens      generated     observation   generated
    [p p p p p p p] [g g g g <eos>] [o o o o o] [g g g <eos>]
    loss_mask  0 ...     1 ... 1        0 ... 0      1 ... 1
    logprobs   None ...  -0.3 ...       None ...     -1.2 ...
    versions   None ...  7 ...          None ...     8 ...

`tokens` are exactly the ids the engine produced plus the ids of what came between turns;
sampled text is never re-tokenised. One JSONL line per sample when dumped, its decoded text
beside the tokens (for people: nothing reads it back).
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Sample:
    """One segment of one rollout.

    Example: Sample(rollout_id="r0", group_id="g0", segment=0, tokens=[5, 6, 7],
    loss_mask=[False, True, True], logprobs=[None, -0.1, -2.3], versions=[None, 0, 0],
    reward=1.0, finish_reason="stop")
    """

    rollout_id: str
    """The episode this segment belongs to; group baselines count a rollout once."""
    group_id: str
    """Rollouts of the same prompt share a group id."""
    segment: int
    """0 for the first segment of a rollout; a new one starts when history is rewritten."""
    tokens: list[int]
    """All token ids of the segment, prompt first. Length T."""
    loss_mask: list[bool]
    """Length T; True exactly on tokens the engine generated."""
    logprobs: list[float | None]
    """Length T; the engine's behaviour log-prob (nats, after temperature) where
    `loss_mask` is True, None elsewhere."""
    versions: list[int | None]
    """Length T; the weight version that generated each token where `loss_mask` is True,
    None elsewhere."""
    reward: float
    """The rollout's reward (sum of per-turn rewards)."""
    finish_reason: str
    """Why the episode ended: stop, length, max_turns, max_tokens, timeout, error."""
    task_id: str = ""
    """The id of the task (dataset row) the rollout ran on."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Sampling settings the tokens were drawn with (temperature, top_p, ...)."""
    info: dict[str, Any] = field(default_factory=dict)
    """Scalars from the agent (`Result.info`) and per-turn rewards."""
    images: list[str] | None = None
    """Images shown to the model, as data URLs, in the order of their placeholders in
    `tokens` (each placeholder expanded as the engine expanded it), when there are any."""
    routed_experts: list[list[list[int]]] | None = None
    """MoE routing per token: [T][layer][top_k] expert ids, when the engine records it."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        n = len(self.tokens)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"sample {self.rollout_id}: {name} has "
                                 f"{len(getattr(self, name))} entries, tokens has {n}")
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise ValueError(f"sample {self.rollout_id}: routed_experts has "
                             f"{len(self.routed_experts)} entries, tokens has {n}")
        for i, (m, lp, v) in enumerate(zip(self.loss_mask, self.logprobs, self.versions)):
            if m and (lp is None or v is None or not lp <= 0.0 or math.isnan(lp)):
                raise ValueError(f"sample {self.rollout_id}: generated token {i} needs a "
                                 f"log-prob <= 0 and a version, got {lp!r}, {v!r}")
            if not m and (lp is not None or v is not None):
                raise ValueError(f"sample {self.rollout_id}: token {i} is not generated "
                                 "(loss_mask False) but has a log-prob or version")
        if not any(self.loss_mask):
            raise ValueError(f"sample {self.rollout_id}: no generated tokens")

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> "Sample":
        return cls(**{k: v for k, v in json.loads(line).items() if k not in NOTES})


def fit_routing(routing: list | None, n: int) -> list | None:
    """The routing of `n` tokens from the engine's last call on them, which ran every
    position but the last sampled token (and anything after it, such as a final observation):
    those positions affect no trained log-prob, so they repeat the last row."""
    return None if routing is None else routing[:n] + routing[-1:] * (n - len(routing))


def one_per_rollout(samples: list[Sample]) -> list[Sample]:
    """The last segment of each rollout: for per-episode figures (reward, turns)."""
    return list({s.rollout_id: s for s in samples}.values())


TEXT = ("prompt_text", "completion_text")
"""The decoded text `write_jsonl` adds beside the tokens, for people to read."""
NOTES = (*TEXT, "step", "trainer_logprobs")
"""What a dump holds beside the sample's fields (`read_jsonl` leaves it): its text, and in
`instar rl`'s rollouts.jsonl the step that trained on the sample and the trainer's log-probs of
its generated tokens (None elsewhere) before that step's update."""


def texts(s: Sample, tokenizer) -> dict[str, str]:
    """The sample's tokens decoded, special tokens kept: the prompt (up to the first generated
    token), and the rest (the generated turns and the observations between them)."""
    k = s.loss_mask.index(True)
    return {"prompt_text": tokenizer.decode(s.tokens[:k]),
            "completion_text": tokenizer.decode(s.tokens[k:])}


def write_jsonl(path: str | Path, samples: list[Sample], tokenizer=None,
                notes: list[dict] | None = None) -> None:
    """Append one line per sample; with `tokenizer`, its decoded text first (`texts`); with
    `notes` (one dict a sample, keys of NOTES), those beside it."""
    with open(path, "a") as f:
        f.writelines(json.dumps({**(texts(s, tokenizer) if tokenizer else {}), **n, **asdict(s)},
                                separators=(",", ":")) + "\n"
                     for s, n in zip(samples, notes or [{}] * len(samples), strict=True))


def read_jsonl(path: str | Path) -> list[Sample]:
    with open(path) as f:
        return [Sample.from_json(line) for line in f if line.strip()]
