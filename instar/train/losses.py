"""Advantages and losses: small pure functions over tensors.

Shapes in names: _B per sequence, _BT per token (B sequences, T positions).
"""

import torch
import torch.nn.functional as F


def token_logprobs(logits_BTV: torch.Tensor, input_ids_BT: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """Log-prob of each token given the ones before it; position 0 gets 0.

    The engine reports log-probs after temperature, so the trainer divides by it too.
    """
    logp = F.log_softmax(logits_BTV[:, :-1].float() / temperature, dim=-1)
    picked_BT = logp.gather(-1, input_ids_BT[:, 1:, None]).squeeze(-1)
    return F.pad(picked_BT, (1, 0))


def grpo_advantages(rewards_B: torch.Tensor, group_B: torch.Tensor,
                    eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of the group) / (std of the group + eps), one group id per rollout."""
    adv_B = torch.empty_like(rewards_B)
    for g in group_B.unique():
        r = rewards_B[group_B == g]
        std = r.std(unbiased=False) if len(r) > 1 else torch.zeros(())
        adv_B[group_B == g] = (r - r.mean()) / (std + eps)
    return adv_B


def pg_clip_loss(logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, adv_B: torch.Tensor,
                 mask_BT: torch.Tensor, clip_low: float, clip_high: float,
                 num_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy-gradient loss, summed over tokens and divided by `num_tokens`.

    `num_tokens` counts the loss tokens of the whole step on all ranks, so the loss is a
    global token mean however the batch is split into ranks and micro-batches.
    """
    ratio_BT = torch.exp(logprobs_BT - old_logprobs_BT)
    adv_BT = adv_B[:, None].expand_as(ratio_BT)
    clipped_BT = ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = -torch.minimum(ratio_BT * adv_BT, clipped_BT * adv_BT)
    loss = (loss_BT * mask_BT).sum() / num_tokens
    with torch.no_grad():
        m = mask_BT.bool()
        stats = {"clip_frac": ((ratio_BT != clipped_BT) & m).sum().item(),
                 "abs_logprob_diff": (logprobs_BT - old_logprobs_BT).abs()[m].sum().item()}
    return loss, stats


def sft_loss(logprobs_BT: torch.Tensor, mask_BT: torch.Tensor,
             num_tokens: int) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, as a global token mean."""
    return -(logprobs_BT * mask_BT).sum() / num_tokens, {}


# Advantage estimators by name (--algo.estimator): (rewards_B, group_B) -> adv_B.
ESTIMATORS = {"grpo": grpo_advantages}
