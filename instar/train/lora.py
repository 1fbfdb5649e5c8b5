"""LoRA adapters: put on the trainer's model (PEFT), moved to the engines, exported.

An adapter moves as a dict, `{"config": PEFT's adapter_config, "tensors": {name: tensor}}`,
its tensors named as PEFT saves them (`base_model.model.<module>.lora_A.weight`). `write`
makes it a PEFT folder: PEFT loads that onto the base model and vLLM serves it (`LoRARequest`).
"""

import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from instar.config import LoraConfig
from instar.train.checkpoint import export_hf, replace_folder

ENGINE_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM sizes its adapter slots for (`max_lora_rank`); an adapter may be smaller."""


def engine_rank(rank: int) -> int:
    """The smallest slot rank vLLM offers that holds an adapter of `rank`."""
    return next(r for r in ENGINE_RANKS if r >= rank)


def engine_modules(model_path: str, targets: str | list[str]) -> list[str]:
    """The modules, by last name, that engines put LoRA on (vLLM's `lora_target_modules`) for
    adapters of `targets` (as PEFT takes them: a regex over module names, or a list of names).
    Never lm_head: with an lm_head adapter vLLM's prompt log-probs, which the sync probe reads,
    fail or drop the adapter (vllm#16668, #51594), so the engines leave it unwrapped."""
    names = targets
    if isinstance(targets, str):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        config = AutoConfig.from_pretrained(model_path)
        auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else \
            AutoModelForCausalLM
        with torch.device("meta"):
            model = auto.from_config(config)
        names = [name for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and re.fullmatch(targets, name)]
    modules = sorted({name.rsplit(".", 1)[-1] for name in names})
    if "lm_head" in modules or not modules:
        raise ValueError(f"LoRA targets {targets!r} match {'lm_head' if modules else 'nothing'} "
                         "in this model: give --lora.targets a regex over its linear layers, "
                         "without lm_head (vLLM serves no lm_head adapter with prompt log-probs)")
    return modules


def wrap(model: torch.nn.Module, lora: LoraConfig, names: tuple[str, ...] = ("default",)):
    """`model` with an adapter on each module `lora.targets` matches, one per name (the
    first active); the base is frozen."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model

    def config():
        return PeftLora(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.targets)
    model = get_peft_model(model, config(), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config())
    model.base_model.set_adapter(names[0])
    return model


def owns(parameter: str, name: str) -> bool:
    """Whether a wrapped model's `parameter` belongs to adapter `name`."""
    return re.search(rf"\.lora_[AB]\.{re.escape(name)}\.", parameter) is not None


def adapter_config(model, name: str = "default") -> dict:
    """A wrapped model's adapter_config.json for adapter `name`, as plain JSON."""
    config = model.peft_config[name].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def saved_name(parameter: str, name: str = "default") -> str:
    """A parameter of adapter `name` as PEFT saves it (without the adapter's name)."""
    return re.sub(rf"\.(lora_[AB])\.{re.escape(name)}\.", r".\1.", parameter)


def num_bytes(adapter: dict) -> int:
    return sum(t.numel() * t.element_size() for t in adapter["tensors"].values())


def write(adapter: dict, folder: Path) -> Path:
    """`adapter` as a PEFT folder, which appears whole (written aside, then renamed)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
    save_file(adapter["tensors"], tmp / "adapter_model.safetensors")
    (tmp / "adapter_config.json").write_text(json.dumps(adapter["config"], indent=2))
    for path in (tmp, *tmp.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    replace_folder(tmp, folder)
    return folder


def read(folder: str | Path) -> dict:
    """A PEFT LoRA folder (--lora.path) as an adapter; a ValueError that says what is wrong."""
    folder = Path(folder)
    files = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not all(f.is_file() for f in files):
        raise ValueError(f"--lora.path {folder}: not a PEFT adapter folder (it needs "
                         "adapter_config.json and adapter_model.safetensors)")
    config = json.loads(files[0].read_text())
    if config.get("peft_type") != "LORA" or not isinstance(config.get("r"), int) or \
            not config.get("target_modules"):
        raise ValueError(f"--lora.path {folder}: adapter_config.json is not a LoRA adapter's "
                         f"(peft_type {config.get('peft_type')!r}, r {config.get('r')!r}, "
                         f"target_modules {config.get('target_modules')!r})")
    if config["r"] > ENGINE_RANKS[-1]:
        raise ValueError(f"--lora.path {folder}: rank {config['r']} is above vLLM's largest, "
                         f"{ENGINE_RANKS[-1]}")
    return {"config": config, "tensors": load_file(files[1])}


def export(adapter: dict, base: Path, out: Path, merge: bool, dtype: torch.dtype) -> None:
    """A run's final/: the adapter as a PEFT folder on `base`; with `merge`, also final/merged,
    the base with the adapter merged in (a Hugging Face folder)."""
    write({**adapter, "config": {**adapter["config"], "base_model_name_or_path": str(base)}}, out)
    if merge:
        export_hf(base, out / "merged",
                  lambda path: save_file(merged_weights(base, out, dtype), path))


def merged_weights(base: Path, folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base's weights with the adapter in `folder` merged in (W + alpha/r B A)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
    weights = merged.state_dict()
    if merged.config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return {k: v.to(dtype).contiguous() for k, v in weights.items()}
