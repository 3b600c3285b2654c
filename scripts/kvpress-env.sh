#!/usr/bin/env bash
# The lab's kvpress copies against NVIDIA kvpress itself (the README's comparison table):
#
#   scripts/kvpress-env.sh [DUMP_DIR]
#
# kvpress pins transformers < 5.3 and wraps every registered attention function on import, so it
# never enters the project's environment: this makes a throw-away venv with torch 2.13.0, kvpress
# 0.5.5 and the newest transformers kvpress accepts, runs scripts/kvpress_dump.py there (kvpress's
# kept entries and logits on tiny checkpoints it builds), then, with the project's .venv, the
# comparison test and the table (scripts/kvpress_table.py). Fails loudly if any step does.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error  # the log shows results, not loading bars
dump=${1:-$(mktemp -d)/kvpress-dump}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0 kvpress==0.5.5 "transformers<5.3" 2>&1 |
  grep -v "^WARNING: Location" || true
"$work/venv/bin/python" -c "import kvpress, transformers; print('kvpress-env: transformers', transformers.__version__)"
"$work/venv/bin/python" scripts/kvpress_dump.py "$dump"
src=$("$work/venv/bin/python" -c "import kvpress, os; print(os.path.dirname(kvpress.__file__))")
GPT_INSPECTOR_KVPRESS_DUMP="$dump" QT_QPA_PLATFORM=offscreen .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/core/test_kvpress_parity.py
GPT_INSPECTOR_KVPRESS_SRC="$src" QT_QPA_PLATFORM=offscreen .venv/bin/python -m pytest -q -p no:cacheprovider \
  tests/core/test_kvpress_own_classes.py
.venv/bin/python scripts/kvpress_table.py "$dump"
