"""Task data in every form `--data.train` takes (JSONL, JSON, Parquet, a `datasets` folder, a
Hub dataset id from the Hub cache) loads into the same tasks; `--data.prompt-key` and
`--data.label-key` map the columns; a missing column is one line naming it, the data and the
flag. Fast: no engine."""

import json

import datasets
import pytest
from huggingface_hub import constants
from test_hub import COMMIT, hub_repo

from instar.config import Config
from instar.data import load_task_data
from instar.inputs import run_inputs

PLAIN = [{"id": "add-2-3", "prompt": "What is 2+3?", "label": 5},
         {"id": "add-51-9", "prompt": "What is 51+9?", "label": 60},
         {"id": "no-label", "prompt": "Say hi.", "label": None}]
CHAT = [{"id": f"chat-{i}", "prompt": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": f"Reverse {w}"}], "label": w[::-1]}
        for i, w in enumerate(["abc", "hello"])]


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    """The `datasets` cache and an offline Hub cache in this test's folder."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def write(folder, rows: list[dict]) -> dict[str, str]:
    """`rows` as each form instar reads."""
    paths = {form: str(folder / f"tasks.{form}") for form in ("jsonl", "json", "parquet")}
    with open(paths["jsonl"], "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    with open(paths["json"], "w") as f:
        json.dump(rows, f)
    datasets.Dataset.from_list(rows).to_parquet(paths["parquet"])
    datasets.Dataset.from_list(rows).save_to_disk(folder / "saved")
    return {**paths, "saved": str(folder / "saved")}


@pytest.mark.parametrize("rows", [PLAIN, CHAT], ids=["text-prompts", "chat-prompts"])
def test_every_form_loads_into_the_same_tasks(tmp_path, rows):
    paths = write(tmp_path, rows)
    tasks = {form: load_task_data(path) for form, path in paths.items()}
    assert [(t.prompt, t.label, t.id, t.data) for t in tasks["jsonl"]] == [
        (r["prompt"], r["label"], r["id"], r) for r in rows]
    for form in ("json", "parquet", "saved"):
        assert tasks[form] == tasks["jsonl"], form


def test_columns_are_mapped_by_prompt_key_and_label_key(tmp_path):
    rows = [{"question": r["prompt"], "answer": r["label"], "prompt": "not this"} for r in PLAIN]
    for form, path in write(tmp_path, rows).items():
        tasks = load_task_data(path, prompt_key="question", label_key="answer")
        assert [(t.prompt, t.label) for t in tasks] == [(r["prompt"], r["label"])
                                                        for r in PLAIN], form


@pytest.mark.parametrize("form", ["json", "parquet", "saved"])
def test_a_missing_column_names_it_the_data_and_the_flag(tmp_path, form):
    path = write(tmp_path, [{"question": "q", "answer": "a"}])[form]
    with pytest.raises(ValueError) as e:
        load_task_data(path)
    assert str(e.value) == (f"--data.train {path}: no column 'prompt' for the prompt (it has "
                            "question, answer): set --data.prompt-key")
    with pytest.raises(ValueError, match=f"^--data.eval {path}: no column 'solution' for the "
                                         r"label \(it has question, answer\): set --data.label-key"):
        load_task_data(path, "question", "solution", "--data.eval")
    assert load_task_data(path, "question")[0].label is None  # the default label column: optional


def test_a_missing_jsonl_field_names_the_file_line_and_flag(tmp_path):
    path = write(tmp_path, [{"question": "q", "answer": "a"}, {"question": "r"}])["jsonl"]
    with pytest.raises(ValueError, match=f"^{path}:1: a task row needs a 'prompt' field .*"
                                         "--data.prompt-key"):
        load_task_data(path)
    with pytest.raises(ValueError, match=f"^{path}:2: a task row needs a 'answer' field .*"
                                         "--data.label-key"):
        load_task_data(path, "question", "answer")


def test_a_dataset_dict_gives_train_to_train_and_test_to_eval(tmp_path):
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(PLAIN[:2]),
                                   "test": datasets.Dataset.from_list(PLAIN[2:])})
    splits.save_to_disk(tmp_path / "splits")
    assert [t.id for t in load_task_data(str(tmp_path / "splits"))] == ["add-2-3", "add-51-9"]
    assert [t.id for t in load_task_data(str(tmp_path / "splits"), flag="--data.eval")] == [
        "no-label"]
    datasets.DatasetDict({"a": splits["train"], "b": splits["test"]}).save_to_disk(tmp_path / "ab")
    with pytest.raises(ValueError, match=r"--data.eval .*ab: no test or validation split \(it "
                                         r"has a, b\)$"):
        load_task_data(str(tmp_path / "ab"), flag="--data.eval")


def test_a_hub_dataset_id_loads_from_the_hub_cache_offline(tmp_path):
    """As `hf download --repo-type dataset org/reverse` leaves it: parquet files per split,
    and a second config named in the dataset card."""
    files = tmp_path / "repo"
    (files / "data").mkdir(parents=True)
    (files / "hard").mkdir()
    datasets.Dataset.from_list(PLAIN[:2]).to_parquet(files / "data" / "train-00000-of-00001.parquet")
    datasets.Dataset.from_list(PLAIN[2:]).to_parquet(files / "data" / "test-00000-of-00001.parquet")
    datasets.Dataset.from_list(CHAT).to_parquet(files / "hard" / "train.parquet")
    (files / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: "
        "data/train-*\n  - split: test\n    path: data/test-*\n- config_name: hard\n  "
        "data_files:\n  - split: train\n    path: hard/train.parquet\n---\n")
    hub_repo(tmp_path / "hub", "org/reverse", files, "dataset")
    assert [t.id for t in load_task_data("org/reverse")] == ["add-2-3", "add-51-9"]
    assert [t.id for t in load_task_data("org/reverse", flag="--data.eval")] == ["no-label"]
    assert [t.label for t in load_task_data("org/reverse:hard")] == ["cba", "olleh"]
    assert (tmp_path / "hub" / "datasets--org--reverse" / "snapshots" / COMMIT).is_dir()


@pytest.mark.parametrize("spec, error", [
    ("org/none", "--data.train org/none: not a local folder, and this Hugging Face Hub id is "
                 "not in the cache while HF_HUB_OFFLINE=1: run `hf download --repo-type dataset "
                 "org/none` where the network is up, or set HF_HUB_OFFLINE=0"),
    ("missing.parquet", "--data.train missing.parquet: no such file"),
    ("./no/such/folder", "--data.train ./no/such/folder: not a .jsonl, .json or .parquet file, "
                         "a datasets folder, nor a Hugging Face Hub dataset id"),
])
def test_data_that_cannot_be_found_is_one_line(spec, error):
    with pytest.raises(ValueError) as e:
        load_task_data(spec)
    assert str(e.value).startswith(error) and "\n" not in str(e.value), str(e.value)


def test_a_file_datasets_cannot_read_is_one_line(tmp_path):
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match=r"^--data.train .*bad.parquet: datasets cannot read it "
                                         r"\(\w+: [^\n]*\)$"):
        load_task_data(str(tmp_path / "bad.parquet"))


def test_run_inputs_maps_the_columns_of_train_and_eval(tmp_path):
    paths = write(tmp_path, [{"q": r["prompt"], "a": r["label"]} for r in PLAIN])
    cfg = Config()
    cfg.data.train, cfg.data.eval, cfg.data.prompt_key, cfg.data.label_key = (
        paths["parquet"], paths["saved"], "q", "a")
    cfg.eval.size = 2
    inputs = run_inputs(cfg)
    assert [t.label for t in inputs.train_tasks] == [5, 60, None]
    assert [t.prompt for t in inputs.eval_tasks] == ["What is 2+3?", "What is 51+9?"]
