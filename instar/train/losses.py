"""Losses: small pure functions over tensors.

Shapes in names: _B per sequence, _BT per token (B sequences, T positions).

A policy loss (`POLICY_LOSSES`) maps log-probs and per-token advantages to a per-token loss
`loss_BT` (and where its clip was active); an aggregation (`AGGREGATIONS`) reduces it to the
step's scalar. Off-policy weights from `importance_weights` multiply `loss_BT` first.
"""

import torch
import torch.nn.functional as F


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor, temperature: float,
                   entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each token given the ones before it; position 0 gets 0. With `entropy`,
    also the entropy of each next-token distribution over the whole vocabulary.

    The engine reports log-probs after temperature, so the trainer divides by it too.
    """
    logp = F.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    picked_BT = F.pad(logp.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1), (1, 0))
    return (picked_BT, F.pad(-(logp.exp() * logp).sum(-1), (1, 0))) if entropy else picked_BT


def token_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """sum over loss tokens of loss_t, / `num_tokens` (the loss tokens of the whole step)."""
    return (loss_BT * mask_BT).sum() / num_tokens


def seq_mean(loss_BT: torch.Tensor, mask_BT: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """sum over sequences of (mean of loss_t over the sequence's loss tokens), / `num_seqs`
    (the sequences of the whole step). A sequence without loss tokens adds 0."""
    per_seq_B = (loss_BT * mask_BT).sum(1) / mask_BT.sum(1).clamp(min=1)
    return per_seq_B.sum() / num_seqs


AGGREGATIONS = {"token": token_mean, "sequence": seq_mean}
"""Loss aggregation by name: (loss_BT, mask_BT, step-wide count of tokens or sequences)."""


def ppo_clip_loss(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor,
                  adv_BT: torch.Tensor, mask_BT: torch.Tensor, clip_low: float,
                  clip_high: float, dual_clip: float | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip, per token, with r_t = exp(logp_t - old_t):

        loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)

    Dual clip (Ye et al. 2020), with dual_clip = c > 1, for A_t < 0 only:
    loss_t = min(loss_t, -c A_t), so a huge ratio cannot blow up the loss (nor its gradient).
    Returns (loss_BT, clipped_BT: r_t outside the band).
    """
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    clipped_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = -torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    if dual_clip is not None:
        loss_BT = torch.where(adv_BT < 0, torch.minimum(loss_BT, -dual_clip * adv_BT), loss_BT)
    return loss_BT, ratio_BT != clipped_BT


def gspo_loss(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, adv_BT: torch.Tensor,
              mask_BT: torch.Tensor, clip_low: float, clip_high: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025), in its per-token form. The sequence ratio is length-normalised,
    s = exp(mean over the sequence's loss tokens of (logp_t - old_t)), and

        s_t = sg(s) * exp(logp_t - sg(logp_t))      (value s, gradient s * grad logp_t)
        loss_t = -min(s_t A_t, clip(s_t, 1 - clip_low, 1 + clip_high) A_t)

    With one advantage per sequence and `seq_mean` this is GSPO's sequence loss exactly.
    Returns (loss_BT, clipped_BT: s outside the band, on all of the sequence's tokens).
    """
    log_s_B = ((logprobs_BT - old_logprobs_BT) * mask_BT).sum(1) / mask_BT.sum(1).clamp(min=1)
    s_BT = torch.exp(log_s_B.detach()[:, None] + logprobs_BT - logprobs_BT.detach())
    clipped_BT = s_BT.clamp(1 - clip_low, 1 + clip_high)
    return -torch.minimum(s_BT * adv_BT, clipped_BT * adv_BT), s_BT != clipped_BT


def cispo_loss(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, adv_BT: torch.Tensor,
               mask_BT: torch.Tensor, clip_low: float, clip_high: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, 2025): a clipped importance weight without gradient times logp,

        loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) * A_t * logp_t

    so every token keeps the gradient -w_t A_t grad logp_t, however far r_t strays.
    clip_low = 1 leaves the weight unbounded below, as MiniMax-M1 does.
    Returns (loss_BT, clipped_BT: r_t outside the band).
    """
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT).detach()
    weight_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    return -weight_BT * adv_BT * logprobs_BT, ratio_BT != weight_BT


POLICY_LOSSES = {"ppo": ppo_clip_loss, "gspo": gspo_loss, "cispo": cispo_loss}
"""Policy losses by name: (logprobs_BT, old_logprobs_BT, adv_BT, mask_BT, clip_low, clip_high)
-> (loss_BT, clipped_BT)."""


def sft_loss(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor,
             num_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, as a global token mean."""
    return -(logprobs_BT * mask_BT).sum() / num_tokens, {}


def kl_BT(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(p || q) on tokens sampled from p (p: `logprobs_BT`, q: the
    reference), with d = log q - log p (Schulman's estimators):

        k1 = -d,   k2 = d^2 / 2,   k3 = exp(d) - d - 1

    As a loss term: `token_mean(beta * kl_BT, ...)`; in the reward: subtract beta * kl_BT from
    the per-token rewards.
    """
    d_BT = ref_logprobs_BT - logprobs_BT
    return {"k1": -d_BT, "k2": d_BT**2 / 2, "k3": d_BT.exp() - d_BT - 1}[kind]


def importance_weights(old_logprobs_BT: torch.Tensor, behaviour_logprobs_BT: torch.Tensor,
                       mask_BT: torch.Tensor, level: str, mode: str, low: float, high: float,
                       num_tokens: int) -> tuple[torch.Tensor, float]:
    """Off-policy correction w = pi_old / mu: trainer log-probs before the update (old) over
    the engine's behaviour log-probs (mu), with l_t = old_t - mu_t on the loss tokens:

        token: w_t = exp(l_t);  sequence: w_t = exp(sum_s l_s);  geometric: w_t = exp(mean_s l_s)

    (sum and mean over the sequence's loss tokens). Outside the band [low, high]:
    `mask` sets w = 0 (drops the token, or the whole sequence); `clip` clamps w into
    [low, high]; `truncate` only caps w at high (truncated IS; `low` unused).
    Returns w_BT, to multiply the per-token loss by, and the number of loss tokens whose
    weight was changed / `num_tokens` (the filtered fraction of the step).
    """
    log_w_BT = (old_logprobs_BT - behaviour_logprobs_BT) * mask_BT
    sum_B1, n_B1 = log_w_BT.sum(1, keepdim=True), mask_BT.sum(1, keepdim=True).clamp(min=1)
    log_w = {"token": log_w_BT, "sequence": sum_B1, "geometric": sum_B1 / n_B1}[level]
    w_BT = log_w.exp().expand_as(log_w_BT)
    out_BT = {"mask": torch.where((w_BT >= low) & (w_BT <= high), w_BT, 0.0),
              "clip": w_BT.clamp(low, high), "truncate": w_BT.clamp(max=high)}[mode]
    filtered = ((out_BT != w_BT) & mask_BT.bool()).sum().item() / num_tokens
    return out_BT, filtered


def mismatch_metrics(logprobs_BT: torch.Tensor, behaviour_logprobs_BT: torch.Tensor,
                     mask_BT: torch.Tensor) -> dict[str, float]:
    """Trainer-vs-engine mismatch over the masked tokens, as sums (the caller divides by
    `mismatch_tokens` summed over the step): |logp_t - mu_t| and k3 = KL(mu || pi) estimated
    on the engine's samples."""
    m = mask_BT.bool()
    diff = (logprobs_BT - behaviour_logprobs_BT).abs()[m].sum()
    k3 = kl_BT(behaviour_logprobs_BT, logprobs_BT, "k3")[m].sum()
    return {"abs_logprob_diff": diff.item(), "k3": k3.item(), "mismatch_tokens": m.sum().item()}


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               clip: float) -> torch.Tensor:
    """PPO's clipped value loss per token (reduce it with `token_mean`):

        loss_t = max((V_t - R_t)^2, (V_old_t + clamp(V_t - V_old_t, -clip, clip) - R_t)^2) / 2
    """
    clipped_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
    return torch.maximum((values_BT - returns_BT) ** 2, (clipped_BT - returns_BT) ** 2) / 2


def policy_loss(logprobs_BT: torch.Tensor, entropy_BT: torch.Tensor, b: dict[str, torch.Tensor],
                a, num_tokens: int, num_seqs: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The RL loss `a` (an AlgoConfig) describes, on one micro-batch `b` (see Rank._batch), as
    this micro-batch's share of the update's scalar:

      1. the policy loss per token, its ratio against the old log-probs: the trainer's own
         before the step's first update, scored before it when a step makes several updates
         (`b["old_logprobs"]`); with one update, this forward's, detached, when off-policy
         correction is on, else the engine's (behaviour: the ratio then measures how far
         the policy has moved from the weights that sampled);
      2. off-policy correction (decoupled PPO): times importance weights old / behaviour;
      3. an entropy bonus, and the KL to a reference model as a loss term, if asked for;
      4. aggregated over tokens or sequences of the whole update.

    Stats are this micro-batch's shares of update means (they sum over micro-batches and
    ranks), but `ratio_max`/`ratio_min`, extremes over the loss tokens (see `combine`).
    """
    mask_BT, behaviour_BT, m = b["mask"], b["behaviour_logprobs"], b["mask"].bool()
    corrected = a.is_mode != "off"
    old_BT = b.get("old_logprobs", logprobs_BT.detach() if corrected else behaviour_BT)
    extra = {"dual_clip": a.dual_clip} if a.policy_loss == "ppo" else {}
    loss_BT, clipped_BT = POLICY_LOSSES[a.policy_loss](logprobs_BT, old_BT, b["advantages"],
                                                       mask_BT, a.clip_low, a.clip_high, **extra)
    # on lag-0 tokens only: with older tokens the policy itself has moved since
    stats = mismatch_metrics(logprobs_BT.detach(), behaviour_BT,
                             mask_BT * b["fresh"] if "fresh" in b else mask_BT)
    stats["clip_frac"] = (clipped_BT & m).sum().item() / num_tokens
    log_r = (logprobs_BT.detach() - old_BT)[m]  # KL(old || now) ~ k3 = r - 1 - log r
    stats["approx_kl"] = (log_r.exp() - 1 - log_r).sum().item() / num_tokens
    if log_r.numel():
        stats["ratio_max"], stats["ratio_min"] = log_r.max().exp().item(), log_r.min().exp().item()
    stats["entropy"] = token_mean(entropy_BT.detach(), mask_BT, num_tokens).item()
    if corrected:
        w_BT, stats["is_filtered"] = importance_weights(old_BT, behaviour_BT, mask_BT, a.is_level,
                                                        a.is_mode, a.is_low, a.is_high, num_tokens)
        loss_BT = loss_BT * w_BT
    if a.entropy_coef:
        loss_BT = loss_BT - a.entropy_coef * entropy_BT
    if a.kl_coef > 0 and not a.kl_in_reward:
        kl_term_BT = kl_BT(logprobs_BT, b["ref_logprobs"], a.kl_estimator)
        stats["kl"] = token_mean(kl_term_BT.detach(), mask_BT, num_tokens).item()
        loss_BT = loss_BT + a.kl_coef * kl_term_BT
    count = num_tokens if a.aggregation == "token" else num_seqs
    return AGGREGATIONS[a.aggregation](loss_BT, mask_BT, count), stats


def combine(totals: dict[str, float], stats: dict[str, float]) -> dict[str, float]:
    """Add one micro-batch's (or rank's) stats into `totals`: shares are summed, `*_max` and
    `*_min` keep the extreme."""
    pick = {"_max": max, "_min": min}
    for k, v in stats.items():
        totals[k] = v if k not in totals else pick.get(k[-4:], lambda x, y: x + y)(totals[k], v)
    return totals


def adaptive_kl(coef: float, kl: float, target: float, horizon: int, samples: int) -> float:
    """Ziegler et al. (2019)'s controller: the KL coefficient after a step that measured `kl`
    per token on `samples` samples, moved toward `target` by at most 20% per `horizon`
    samples: coef * (1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon)."""
    return coef * (1 + min(max(kl / target - 1, -0.2), 0.2) * samples / horizon)
