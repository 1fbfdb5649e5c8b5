"""The exported model (`final/`) is readable by other users, whatever the temporary files it
was assembled from allowed: files 0o644, folders 0o755. Fast: no Ray."""

import os
import stat
import tempfile

from instar.train.checkpoint import export_hf


def private_weights(path: str) -> None:
    """As the trainer's rank 0 writes them (rank.atomic_save): a mkstemp file (0o600), renamed."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
    os.write(fd, b"weights")
    os.close(fd)
    os.replace(tmp, path)


def test_an_exported_folder_is_readable_by_others(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (base / name).write_text("{}")
        (base / name).chmod(0o600)  # a private source file
    export_hf(base, tmp_path / "run" / "final", private_weights)
    final = tmp_path / "run" / "final"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (final, *final.iterdir())}
    assert modes == {"final": 0o755, "config.json": 0o644, "tokenizer.json": 0o644,
                     "model.safetensors": 0o644}, {k: oct(v) for k, v in modes.items()}
