"""Runs inside vLLM's worker processes (`worker_extension_cls`): loads pushed weights in place."""

from safetensors.torch import load_file


class WeightReceiver:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def load_safetensors(self, path: str) -> None:
        """Reload the model's weights from a safetensors file (Hugging Face names)."""
        self.model_runner.reload_weights(weights_iterator=iter(load_file(path).items()))
        # A tied output layer shares the embedding's weight but is not reloaded itself; on
        # CPU it keeps a prepacked copy of the old weight, so it is re-processed here.
        model = self.model_runner.model
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None and any(m is not lm_head and getattr(m, "weight", None) is lm_head.weight
                                       for m in model.modules()):
            lm_head.quant_method.process_weights_after_loading(lm_head)
