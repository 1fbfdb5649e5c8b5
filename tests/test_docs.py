"""The README and docs/ hold together: the quick start's commands are what the Makefile and CI
run, and every relative link (and its #anchor) points at a file and heading that exist. Fast:
reads files only."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.lstrip("#").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {anchor(line) for line in prose(path) if line.startswith("#")}


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Quick start.*?```bash\n(.*?)```", text, re.S)
    assert block, "README.md has no Quick start section with a bash block"
    return [line.split("#")[0].strip() for line in block[1].splitlines() if line.strip()]


def test_quick_start_is_make_run_and_make_test_and_ci_runs_the_test_command():
    commands = quick_start_commands()
    assert commands == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for command in commands:
        assert re.search(rf"^{command.split()[1]}:", makefile, re.M), f"no Makefile target: {command}"
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == commands[1], ".ci/run must end with the README's test command"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(doc):
    broken = []
    for line in prose(doc):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, fragment = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{target}: no such file")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{target}: no heading with that anchor in {path.name}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def documented_commands() -> list[tuple[str, list[str]]]:
    """Every `instar rl|sft|eval|rollout|serve ...` line of a fenced block in README.md and
    docs/ (continuation lines joined; those with [optional] parts, "...", shell variables or a
    placeholder recipe left out)."""
    found = []
    for path in DOCS:
        fenced, text = False, ""
        for line in path.read_text().splitlines():
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced:
                text += line.split(" #")[0].rstrip().removesuffix("\\") + (
                    " " if line.rstrip().endswith("\\") else "\n")
        for m in re.finditer(r"(?:^|\s)instar (rl|sft|eval|rollout|serve)((?: [^\n]*)?)$", text, re.M):
            config = re.search(r"--config (\S+)", m[2])
            if not re.search(r"[\[$<]|\.\.\.", m[2]) and (not config or (ROOT / config[1]).exists()):
                found.append((f"{path.name}: instar {m[1]}{m[2]}", m[1], m[2]))
    return found


@pytest.mark.parametrize("where, command, args", documented_commands(), ids=lambda v: str(v)[:60])
def test_documented_commands_validate(where, command, args, monkeypatch, capsys):
    """The commands the docs show pass validate() as written (on any machine: --print-config),
    the GPU ones included."""
    import shlex

    from instar.cli import parse

    monkeypatch.chdir(ROOT)  # (recipes/ paths are relative to the repository)
    cfg, printed = parse(command, [*shlex.split(args), "--print-config"])
    assert printed, where


def test_the_docs_show_gpu_commands():
    gpu = [w for w, _, args in documented_commands() if "recipes/" in args or "cuda" in args]
    assert gpu, "no GPU command found in README.md or docs/ to check"
