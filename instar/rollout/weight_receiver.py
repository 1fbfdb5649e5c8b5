"""Runs inside vLLM's worker processes (`worker_extension_cls`): loads pushed weights in place."""

import torch
from safetensors.torch import load_file

try:  # vLLM-CPU's fused-MoE kernel (other builds have none to repack)
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
except ImportError:
    CPUUnquantizedExperts = ()


class WeightReceiver:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def load_safetensors(self, paths: list[str]) -> None:
        """Reload weights from safetensors files (Hugging Face names). A tensor found in
        several files was sharded over trainer ranks: its parts are concatenated in order."""
        files = [load_file(p) for p in paths]
        names = dict.fromkeys(n for f in files for n in f)
        self.model_runner.reload_weights(weights_iterator=(
            (n, torch.cat([f[n] for f in files if n in f])) for n in names))
        # A tied output layer shares the embedding's weight but is not reloaded itself; on
        # CPU it keeps a prepacked copy of the old weight, so it is re-processed here.
        model = self.model_runner.model
        lm_head = getattr(getattr(model, "language_model", model), "lm_head", None)  # (VLMs)
        if lm_head is not None and any(m is not lm_head and getattr(m, "weight", None) is lm_head.weight
                                       for m in model.modules()):
            lm_head.quant_method.process_weights_after_loading(lm_head)
        # vLLM-CPU's fused-MoE kernel reads a prepacked layout of the expert weights; the
        # reload copies the new weights over it unpacked, so each reloaded layer is repacked.
        for m in model.modules():
            experts = getattr(getattr(m, "quant_method", None), "moe_kernel", None)
            experts = getattr(experts, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts) and any(
                    n.startswith(m.layer_name + ".") for n in names):
                experts.process_weights_after_loading(m)
