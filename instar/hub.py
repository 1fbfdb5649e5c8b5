"""Local folders for `--model.path`, `--agent.judge`, `--algo.teacher`, `--algo.reference` and
Hub datasets: a local folder as given, or a Hugging Face Hub id through the Hub's cache.

    resolve_model("Qwen/Qwen3-0.6B", "--model.path")  # -> ~/.cache/huggingface/hub/models--
                                                       #    Qwen--Qwen3-0.6B/snapshots/<commit>

The cache is huggingface_hub's (`HF_HOME`, `HF_HUB_CACHE`); with `HF_HUB_OFFLINE=1` only what
is cached there is used (fill it with `hf download ID`). An existing local folder wins over an
id. Every failure is a one-line ValueError naming the flag.
"""

from pathlib import Path

# What a model needs (config, tokenizer, chat template, safetensors weights); not the .bin,
# GGUF or original/ copies some repositories carry as well.
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def is_hub_id(spec: str) -> bool:
    """`name` or `org/name` as the Hub spells repository ids."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def snapshot(repo_id: str, flag: str, repo_type: str = "model", weights: bool = True) -> Path:
    """The cached snapshot of Hub repository `repo_id`, downloaded first unless offline
    (a model's weights only if `weights`)."""
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    get = f"`hf download {'' if repo_type == 'model' else f'--repo-type {repo_type} '}{repo_id}`"
    patterns = [p for p in MODEL_FILES if weights or p != "*.safetensors"] \
        if repo_type == "model" else None
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, allow_patterns=patterns))
    except RepositoryNotFoundError as e:
        raise ValueError(f"{flag} {repo_id}: not a local folder, and no {repo_type} on the Hub "
                         "has this id (or it is private or gated: `hf auth login`)") from e
    except LocalEntryNotFoundError as e:
        if is_offline_mode():
            raise ValueError(f"{flag} {repo_id}: not a local folder, and this Hugging Face Hub id "
                             f"is not in the cache while HF_HUB_OFFLINE=1: run {get} where the "
                             "network is up, or set HF_HUB_OFFLINE=0") from e
        error = e.__cause__ or e
    except Exception as e:  # the network, the disk, the Hub
        error = e
    first_line = (str(error).splitlines() or [""])[0]
    raise ValueError(f"{flag} {repo_id}: not a local folder, and the download from the Hugging "
                     f"Face Hub failed ({type(error).__name__}: {first_line}); run {get}, or pass "
                     "a local folder") from error


def model_name(path: Path) -> str:
    """What the gateway calls the model at `path`: the Hub id of a cached snapshot (not its
    commit hash), else the folder's name."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


def resolve_model(spec: str, flag: str, weights: bool = True) -> Path:
    """The folder of the model `spec` names: a local folder with config.json, or a Hub id
    (whose weights are fetched only if `weights`)."""
    path = Path(spec).expanduser()
    if (path / "config.json").is_file():
        return path.absolute()
    if path.exists() or not is_hub_id(spec):
        raise ValueError(f"{flag} {spec}: not a folder with config.json, nor a Hugging Face "
                         "Hub id (org/name)")
    folder = snapshot(spec, flag, weights=weights)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} {spec}: the Hub repository has no config.json (not a "
                         "transformers model)")
    return folder
