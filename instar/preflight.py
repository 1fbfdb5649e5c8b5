"""The preflight gate: before step 1, the trainer rescores freshly sampled tokens and the run
stops, with the most likely cause, if its log-probs disagree with the engine's."""

import ray

from instar.evaluate import mean
from instar.rollout.versions import POLICY
from instar.sample import Sample
from instar.train.batch import Sequence
from instar.train.trainer import Trainer


def preflight(samples: list[Sample], trainer: Trainer, engine, temperature: float,
              tol: float, policy: str = POLICY) -> float:
    """Before step 1: the trainer rescores freshly sampled tokens; if its log-probs disagree
    with the engine's behaviour log-probs by more than `tol` (mean |Δ|), stop with the most
    likely cause. The mean |Δ| otherwise. (A loss mask on tokens the engine did not sample
    is refused earlier, when the Sample is built.)"""
    seqs = [Sequence(s.tokens, s.loss_mask, [lp or 0.0 for lp in s.logprobs], images=s.images)
            for s in samples]

    def mismatch(scores):
        return mean(abs(a - b) for q, sc in zip(seqs, scores)
                    for a, b, m in zip(q.behaviour_logprobs, sc, q.mask) if m)
    diff = mismatch(trainer.score(seqs, temperature))
    if diff <= tol:
        return diff
    ids = seqs[0].tokens  # the same tokens, teacher-forced, in both: do the weights agree?
    weights = max(abs(a - b) for a, b in zip(ray.get(engine.prompt_logprobs.remote(ids, policy))[1:],
                                             trainer.probe(ids)[1:]))
    if weights > tol:
        cause = (f"the engine and the trainer give the same tokens different log-probs "
                 f"({weights:.2e}): they hold different weights (stale weights, another "
                 "checkpoint) or compute differently (dtype)")
    elif mismatch(trainer.score(seqs, 1.0)) <= tol:
        cause = (f"the behaviour log-probs fit temperature 1.0, not {temperature}: the "
                 "sampling transform differs between engine and trainer")
    else:
        cause = ("the weights agree, so the sampled tokens came from another context than the "
                 "trainer sees: the sample's tokens are not the ones the engine was given (a "
                 "re-rendered prompt, a wrong chat template, re-tokenised text)")
    raise RuntimeError(f"preflight failed: on {len(samples)} fresh samples the trainer's "
                       f"log-probs differ from the engine's by {diff:.2e} on average (> "
                       f"{tol:.0e}, --rollout.preflight-tol). Likely cause: {cause}")
