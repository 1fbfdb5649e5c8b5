"""MoE routing replay: the trainer's forward uses the experts the engine chose.

The engine records, per token and decoder layer, the top-k experts it routed to
(`Sample.routed_experts`, [T][layer][top_k]). The trainer's own top-k can pick other
experts (other kernels, batch shapes, rounding), and then it trains a different function
from the one that sampled. With replay, each Qwen3-MoE router keeps its logits but its
top-k is the recorded one; the chosen experts' weights still come from the router's
softmax, so the router is trained as before.

    replay = RoutingReplay(model)
    replay.use(recorded_BTLK)             # [B, T, layers, top_k]; None: the router's own top-k
    model(input_ids=...)                  # (and the backward, recomputed layers included)
"""

import re
from functools import partial

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter


class RoutingReplay:
    """Forward hooks on every Qwen3-MoE router of `model`, replaying `experts_BTLK` when set."""

    def __init__(self, model: torch.nn.Module):
        self.experts_BTLK: torch.Tensor | None = None
        self.routers = 0
        for name, module in model.named_modules():
            if isinstance(module, Qwen3MoeTopKRouter):  # model.layers.N.mlp.gate
                layer = int(re.search(r"layers\.(\d+)\.", name).group(1))
                module.register_forward_hook(partial(self._replay, layer))
                self.routers += 1

    def use(self, experts_BTLK: torch.Tensor | None) -> None:
        """Replay these choices in the forwards from now on (None: the routers' own top-k)."""
        if experts_BTLK is not None and not self.routers:
            raise ValueError("the samples carry MoE routing but the model has no Qwen3-MoE "
                             "router to replay it in; turn replay off: --train.no-routing-replay")
        self.experts_BTLK = experts_BTLK

    def _replay(self, layer: int, router: Qwen3MoeTopKRouter, inputs, outputs):
        if self.experts_BTLK is None:
            return None
        logits_NE = outputs[0]  # N = B * T tokens, E experts
        experts_NK = self.experts_BTLK[:, :, layer].reshape(-1, router.top_k)
        weights_NK = logits_NE.softmax(-1, dtype=torch.float32).gather(-1, experts_NK)
        if router.norm_topk_prob:
            weights_NK = weights_NK / weights_NK.sum(-1, keepdim=True)
        return logits_NE, weights_NK.to(logits_NE.dtype), experts_NK
