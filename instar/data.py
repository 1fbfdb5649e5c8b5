"""Task data for `--data.train` and `--data.eval`, in any of the forms a Hugging Face user has:

    tasks.jsonl          one JSON object a line (instar's reader: a bad row is named file:line)
    tasks.json           a JSON array of objects (or JSON lines), through `datasets`
    tasks.parquet        through `datasets`
    saved/               a folder written by `Dataset.save_to_disk` (or a folder of data files)
    org/name[:config]    a Hub dataset: its snapshot in the Hub cache (instar/hub.py), read by
                         `datasets` with that config

`--data.prompt-key` and `--data.label-key` name the prompt and label columns. A DatasetDict
(several splits) gives its `train` split to `--data.train`, its `test` (else `validation`)
split to `--data.eval`.
"""

from pathlib import Path

from instar.agents.contract import Task
from instar.agents.loading import load_tasks
from instar.hub import is_hub_id, snapshot

FORMATS = {".json": "json", ".parquet": "parquet"}
SPLITS = {"--data.train": ("train",), "--data.eval": ("test", "validation")}


def load_task_data(spec: str, prompt_key: str = "prompt", label_key: str = "label",
                   flag: str = "--data.train") -> list[Task]:
    """The tasks in `spec` (see the module docstring); `flag` names it in errors."""
    path = Path(spec)
    if path.suffix in (".jsonl", *FORMATS) and not path.is_file():
        raise ValueError(f"{flag} {spec}: no such file")
    if path.suffix == ".jsonl":
        return load_tasks(spec, prompt_key, label_key)
    rows = read_dataset(spec, flag)
    columns = rows.column_names
    if prompt_key not in columns:
        raise ValueError(f"{flag} {spec}: no column {prompt_key!r} for the prompt (it has "
                         f"{', '.join(columns)}): set --data.prompt-key")
    if label_key != "label" and label_key not in columns:
        raise ValueError(f"{flag} {spec}: no column {label_key!r} for the label (it has "
                         f"{', '.join(columns)}): set --data.label-key")
    return [Task(prompt=row[prompt_key], label=row.get(label_key), id=str(row.get("id", i)),
                 data=row) for i, row in enumerate(rows)]


def read_dataset(spec: str, flag: str):
    """`spec` as one `datasets.Dataset`: the split `flag` takes from a DatasetDict."""
    import datasets

    path, (repo_id, _, config) = Path(spec), spec.partition(":")
    if (path.is_file() and path.suffix not in FORMATS) or (not path.exists()
                                                           and not is_hub_id(repo_id)):
        raise ValueError(f"{flag} {spec}: not a .jsonl, .json or .parquet file, a datasets "
                         "folder, nor a Hugging Face Hub dataset id (org/name[:config])")
    folder = path if path.exists() else snapshot(repo_id, flag, "dataset")
    try:
        if path.is_file():
            data = datasets.load_dataset(FORMATS[path.suffix], data_files=spec, split="train")
        elif (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file():
            data = datasets.load_from_disk(str(folder))
        else:  # a folder of data files, such as a Hub dataset's snapshot
            data = datasets.load_dataset(str(folder), config or None)
    except Exception as e:  # the library's own errors, as one line
        raise ValueError(f"{flag} {spec}: datasets cannot read it ({type(e).__name__}: "
                         f"{(str(e).splitlines() or [''])[0]})") from e
    if isinstance(data, datasets.DatasetDict):
        names = [s for s in SPLITS[flag] if s in data] or (list(data) if len(data) == 1 else [])
        if not names:
            raise ValueError(f"{flag} {spec}: no {' or '.join(SPLITS[flag])} split (it has "
                             f"{', '.join(data)})")
        data = data[names[0]]
    return data
