"""The per-step health metrics, on hand-made samples: reward spread, groups with no spread,
truncation, and the statistics of the advantages the update trained with. Fast: no engine."""

import math

import pytest

from instar.config import Config
from instar.metrics import StepResult, step_metrics
from instar.rollout.runner import Batch
from instar.sample import Sample


def sample(rollout: str, group: str, reward: float, finish: str = "stop", segment: int = 0,
           generated: int = 2) -> Sample:
    return Sample(rollout_id=rollout, group_id=group, segment=segment, tokens=[1, 2] + [3] * generated,
                  loss_mask=[False, False] + [True] * generated,
                  logprobs=[None, None] + [-0.5] * generated,
                  versions=[None, None] + [0] * generated, reward=reward, finish_reason=finish)


def metrics(samples: list[Sample]) -> dict:
    return step_metrics(StepResult(1, Batch(samples), samples, {}, 0.0, [],
                                   {"wait": 0.0, "train": 0.0, "sync": 0.0}))


def test_reward_spread_groups_without_spread_and_truncation():
    m = metrics([
        sample("a0", "a", 1.0, "length"), sample("a1", "a", 0.0),  # spread
        sample("b0", "b", 0.5, "max_tokens"), sample("b1", "b", 0.5, "truncated"),  # none
        # a rollout of two segments counts once, by its last: this one is not truncated
        sample("c0", "c", 0.25, "length", segment=0), sample("c0", "c", 0.25, "stop", segment=1),
    ])
    rewards = [1.0, 0.0, 0.5, 0.5, 0.25]
    mu = sum(rewards) / 5
    assert m["rollout/reward_std"] == pytest.approx(math.sqrt(sum((r - mu) ** 2 for r in rewards) / 5))
    assert m["rollout/no_spread_groups"] == pytest.approx(2 / 3)  # b, and c (one rollout)
    assert m["rollout/truncated"] == pytest.approx(2 / 5)  # out of tokens: length, max_tokens
    same = metrics([sample("a0", "a", 1.0), sample("a1", "a", 1.0)])
    assert (same["rollout/reward_std"], same["rollout/no_spread_groups"],
            same["rollout/truncated"]) == (0.0, 1.0, 0.0)


class Recorder:
    """A trainer's `step` that keeps what it was given."""

    def step(self, seqs, loss, lr, algo=None):
        self.seqs = seqs
        return {"loss": 0.0, "mismatch_tokens": 0, "abs_logprob_diff": 0.0, "k3": 0.0}


@pytest.mark.parametrize("estimator", ["grpo", "reinforce"])
def test_advantage_statistics_are_those_of_the_advantages_trained_with(estimator):
    from instar.loop import learn

    cfg = Config()
    cfg.algo.estimator = estimator
    samples = [sample("a0", "a", 1.0, generated=3), sample("a1", "a", 0.0),
               sample("a2", "a", 0.0, generated=1), sample("b0", "b", 0.3),
               sample("b1", "b", 0.6)]
    trainer = Recorder()
    stats = learn(samples, trainer, {}, cfg, 1)
    per_seq = [sum(a for a, m in zip(q.advantages, q.mask) if m) / sum(q.mask)
               for q in trainer.seqs]
    mu = sum(per_seq) / len(per_seq)
    assert stats["adv_mean"] == pytest.approx(mu)
    assert stats["adv_std"] == pytest.approx(math.sqrt(sum((a - mu) ** 2 for a in per_seq)
                                                       / len(per_seq)))
    assert (stats["adv_min"], stats["adv_max"]) == pytest.approx((min(per_seq), max(per_seq)))
    assert stats["adv_max"] > stats["adv_min"]
