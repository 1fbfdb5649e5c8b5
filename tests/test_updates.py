"""A step's updates as `learn` makes them (fast: a recording trainer, no Ray): one update per
step is exactly the single optimizer step of before; --algo.epochs x --algo.mini-batches
updates each see a shuffled part of the batch, all against the old policy scored once before
the first; truncated episodes can be left out of the loss but stay in their group's baseline."""

import pytest
from test_metrics import sample

from instar.config import Config
from instar.loop import learn


class Recorder:
    """A trainer that keeps its calls: `step`'s sequences, and `score`s."""

    def __init__(self):
        self.calls = []

    def step(self, seqs, loss, lr, algo=None):
        self.calls.append(("step", seqs))
        self.algo = algo
        n = len(self.calls)
        return {"loss": float(n), "clip_frac": 0.0, "approx_kl": 0.0, "ratio_max": 1 + n / 10,
                "ratio_min": 1 - n / 10, "grad_norm": 1.0, "mismatch_tokens": 2,
                "abs_logprob_diff": 0.2, "k3": 0.0}

    def score(self, seqs, temperature):
        self.calls.append(("score", seqs))
        return [[-0.25] * len(q.tokens) for q in seqs]


def batch():
    return [sample(f"{g}{i}", g, float(i == 0), generated=2 + i) for g in "abc" for i in range(2)]


def config(**algo) -> Config:
    cfg = Config()
    for k, v in algo.items():
        setattr(cfg.algo, k, v)
    return cfg.validate()


@pytest.mark.parametrize("is_mode", ["off", "clip"])
def test_one_update_per_step_is_the_single_step_of_before(is_mode):
    samples, trainer = batch(), Recorder()
    stats = learn(samples, trainer, {}, config(is_mode=is_mode), 3)
    ((kind, seqs),) = trainer.calls  # one step: no scoring pass, no shuffle, no split
    assert kind == "step" and [q.tokens for q in seqs] == [s.tokens for s in samples]
    assert all(q.old_logprobs is None for q in seqs)  # the old policy is the forward's own
    assert "updates" not in stats and stats["abs_logprob_diff"] == 0.1


def test_epochs_of_shuffled_mini_batches_against_the_old_policy_scored_once():
    samples, trainer = batch(), Recorder()
    stats = learn(samples, trainer, {}, config(epochs=2, mini_batches=2, is_mode="clip"), 3)
    kinds = [k for k, _ in trainer.calls]
    assert kinds == ["score", "step", "step", "step", "step"]
    parts = [seqs for _, seqs in trainer.calls[1:]]
    for epoch in (parts[:2], parts[2:]):  # each pass covers the batch once, in two halves
        assert sorted(q.tokens for p in epoch for q in p) == sorted(s.tokens for s in samples)
        assert [len(p) for p in epoch] == [3, 3]
    assert all(q.old_logprobs == [-0.25] * len(q.tokens) for p in parts for q in p)
    assert [u["loss"] for u in stats["updates"]] == [2.0, 3.0, 4.0, 5.0]
    # each update's ratio spread, and the step's extremes over all of them
    assert [(u["ratio_min"], u["ratio_max"]) for u in stats["updates"]] == \
        [(1 - n / 10, 1 + n / 10) for n in (2, 3, 4, 5)]
    assert (stats["ratio_min"], stats["ratio_max"]) == (0.5, 1.5)
    assert stats["loss"] == 3.5
    # the shuffle is the step's own: the same again (exact resume), another at another step
    again = Recorder()
    learn(samples, again, {}, config(epochs=2, mini_batches=2, is_mode="clip"), 3)
    assert [[q.tokens for q in s] for _, s in again.calls] == [[q.tokens for q in s] for _, s in trainer.calls]
    # without off-policy correction too: the ratio is against the old policy, scored once
    plain = Recorder()
    learn(samples, plain, {}, config(epochs=2, mini_batches=2), 3)
    assert [k for k, _ in plain.calls] == ["score"] + ["step"] * 4
    assert all(q.old_logprobs == [-0.25] * len(q.tokens) for _, p in plain.calls[1:] for q in p)


def test_truncated_episodes_leave_the_loss_but_stay_in_the_baseline():
    samples = batch()
    samples[1] = sample("a1", "a", 0.0, "length", generated=3)
    kept, masked = Recorder(), Recorder()
    learn(samples, kept, {}, config(), 1)
    learn(samples, masked, {}, config(overlong_mask=True), 1)
    (_, before), (_, after) = kept.calls[0], masked.calls[0]
    assert not any(after[1].mask) and any(before[1].mask)
    assert [q.advantages for q in after] == [q.advantages for q in before]  # same baseline
    assert [q.mask for i, q in enumerate(after) if i != 1] == [q.mask for i, q in enumerate(before) if i != 1]


def test_the_adaptive_kl_coefficient_reaches_the_loss():
    trainer = Recorder()
    stats = learn(batch(), trainer, {}, config(kl_coef=0.1, kl_target=0.01), 1, kl_coef=0.05)
    assert trainer.algo.kl_coef == 0.05 and stats["kl_coef"] == 0.05
