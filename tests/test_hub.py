"""Hub ids for `--model.path`, `--agent.judge`, `--algo.teacher`, `--algo.reference`: resolved
through huggingface_hub's cache, here one laid out locally (no network), with HF_HUB_OFFLINE;
a local folder wins over an id; every failure is one line naming the flag. Fast: no engine."""

import hashlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub import constants

from instar.config import Config
from instar.hub import model_name, resolve_model
from instar.inputs import model_path, other_model_paths, run_inputs
from instar.tasks.tiny_model import builtin_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_repo(cache: Path, repo_id: str, files: Path, repo_type: str = "model") -> Path:
    """Lay the files of folder `files` out as the Hub cache holds `repo_id` at one commit:
    blobs named by hash, the snapshot's files linked to them, refs/main naming the commit."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    for f in sorted(files.rglob("*")):
        if f.is_file():
            blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(f.read_bytes())
            (snapshot / f.relative_to(files)).parent.mkdir(parents=True, exist_ok=True)
            (snapshot / f.relative_to(files)).symlink_to(os.path.relpath(
                blob, (snapshot / f.relative_to(files)).parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An offline Hub cache holding the built-in tiny model as `org/tiny`."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_repo(cache, "org/tiny", builtin_model())
    return cache


def config(**sections) -> Config:
    cfg = Config()
    for path, value in sections.items():
        section, name = path.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_a_hub_id_resolves_to_its_cached_snapshot_offline(hub):
    snapshot = hub / "models--org--tiny" / "snapshots" / COMMIT
    assert resolve_model("org/tiny", "--model.path") == snapshot
    assert model_path(config(model__path="org/tiny")) == snapshot
    inputs = run_inputs(config(model__path="org/tiny"))
    assert inputs.model_path == snapshot and inputs.tokenizer.encode("abc")
    assert model_name(snapshot) == "org/tiny"  # what the gateway calls it, not the commit
    assert model_name(builtin_model("dense", "tiny", 0)) == builtin_model("dense", "tiny", 0).name


def test_the_environment_chooses_the_cache_and_offline_mode(hub, tmp_path):
    """HF_HUB_CACHE and HF_HUB_OFFLINE=1 as a user sets them, in a fresh process."""
    code = "from instar.hub import model_name, resolve_model; print(resolve_model('org/tiny', '--model.path'))"
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == str(hub / "models--org--tiny" / "snapshots" / COMMIT), out.stderr


def test_a_local_folder_wins_over_a_hub_id(hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    (tmp_path / "org" / "tiny" / "config.json").write_text("{}")
    assert resolve_model("org/tiny", "--model.path") == tmp_path / "org" / "tiny"


def test_the_judge_teacher_and_reference_take_hub_ids(hub):
    snapshot = hub / "models--org--tiny" / "snapshots" / COMMIT
    cfg = config(agent__judge="org/tiny", algo__teacher="org/tiny", algo__reference="org/tiny")
    assert other_model_paths(cfg) == {"judge": snapshot, "teacher": snapshot,
                                      "reference": snapshot}
    assert other_model_paths(config(agent__judge="policy")) == {}
    config(agent__judge="org/tiny").validate()  # no longer refused as "not a folder"


@pytest.mark.parametrize("flag, spec, error", [
    ("--model.path", "/no/such/dir",
     "--model.path /no/such/dir: not a folder with config.json, nor a Hugging Face Hub id"),
    ("--model.path", "org/missing",
     "--model.path org/missing: not a local folder, and this Hugging Face Hub id is not in the "
     "cache while HF_HUB_OFFLINE=1: run `hf download org/missing` where the network is up, or "
     "set HF_HUB_OFFLINE=0"),
    ("--algo.teacher", "./no-such-teacher",
     "--algo.teacher ./no-such-teacher: not a folder with config.json"),
])
def test_a_model_that_cannot_be_found_is_one_line_naming_the_flag(hub, flag, spec, error):
    with pytest.raises(ValueError) as e:
        resolve_model(spec, flag)
    assert str(e.value).startswith(error) and "\n" not in str(e.value), str(e.value)


def test_a_folder_without_config_json_is_not_a_model(hub, tmp_path):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ValueError, match="weights: not a folder with config.json"):
        resolve_model(str(tmp_path / "weights"), "--model.path")


def test_run_inputs_checks_the_judge_before_anything_starts(hub):
    with pytest.raises(ValueError, match="^--agent.judge org/no-judge: not a local folder"):
        run_inputs(config(agent__judge="org/no-judge"))


def test_a_failed_download_says_what_to_do(hub, monkeypatch):
    """Online, with the Hub unreachable (a closed port on this machine) and nothing cached."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError) as e:
        resolve_model("org/missing", "--model.path")
    message = str(e.value)
    assert message.startswith("--model.path org/missing: not a local folder, and the download "
                              "from the Hugging Face Hub failed (") and "\n" not in message
    assert message.endswith("run `hf download org/missing`, or pass a local folder"), message
    assert resolve_model("org/tiny", "--model.path").parent.name == "snapshots"  # cached: used


def test_check_model_takes_a_hub_id_and_fetches_no_weights(hub, monkeypatch):
    import huggingface_hub

    from instar.check_model import load

    asked, fetch = [], huggingface_hub.snapshot_download
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: asked.append(k["allow_patterns"]) or fetch(*a, **k))
    folder, tokenizer = load("org/tiny", "", "")
    assert folder == hub / "models--org--tiny" / "snapshots" / COMMIT and tokenizer.chat_template
    assert "*.json" in asked[0] and "*.safetensors" not in asked[0]
    with pytest.raises(ValueError, match="^checkpoint org/missing: not a local folder, and this "
                                         "Hugging Face Hub id is not in the cache"):
        load("org/missing", "", "")
