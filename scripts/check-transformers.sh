#!/usr/bin/env bash
# Before raising the transformers cap in pyproject.toml: does the parity suite pass on a release?
#
#   scripts/check-transformers.sh            the newest transformers on the registry
#   scripts/check-transformers.sh 5.14.1     a given release (the declared floor, say)
#   scripts/check-transformers.sh 5.25.0 tests/parity/test_families.py -k llama   other tests
#
# Builds a throw-away venv (torch 2.13.0, this checkout's package and test extras, then that
# transformers over the capped one), runs the tests (default: tests/parity, the HF-equality contract)
# and prints one line per model family that broke, then a summary line. Exit status: pytest's.
set -euo pipefail
cd "$(dirname "$0")/.."
want=${1:-}
shift || true
tests=("$@")
((${#tests[@]})) || tests=(tests/parity)
if [[ -z $want ]]; then
  want=$(python3 -m pip index versions transformers 2>/dev/null | sed -n 's/^transformers (\(.*\))$/\1/p')
  [[ -n $want ]] || { echo "check-transformers: cannot read the newest release from the registry" >&2; exit 2; }
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "check-transformers: transformers $want in a throw-away venv ($work)"
python3 -m venv "$work/venv"
pip=("$work/venv/bin/pip" install -q --disable-pip-version-check)
"${pip[@]}" torch==2.13.0 -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
# over the cap on purpose: pip says the installed gpt-inspector does not allow it, which is the point
"${pip[@]}" "transformers==$want" 2>&1 | grep -vE "^WARNING: Location|^ERROR: pip's dependency resolver|requires transformers|incompatible" || true
got=$("$work/venv/bin/python" -c "import transformers; print(transformers.__version__)")
[[ $got == "$want" ]] || { echo "check-transformers: asked for $want, the venv has $got" >&2; exit 2; }
set +e
QT_QPA_PLATFORM=offscreen "$work/venv/bin/python" -m pytest -q -p no:cacheprovider -rf --timeout 600 \
  "${tests[@]}" >"$work/log" 2>&1
rc=$?
set -e
# one line per family: the parametrized test ids carry the family in brackets
failed=$(grep -E "^FAILED " "$work/log" | sed -E 's/^FAILED ([^ ]+).*/\1/' || true)
if [[ -n $failed ]]; then
  sed -nE 's/.*\[([^]]+)\].*/\1/p' <<<"$failed" | sort | uniq -c |
    awk -v v="$want" '{printf "broken on transformers %s: %s (%d tests)\n", v, $2, $1}'
  grep -v "\[" <<<"$failed" | sed 's/^/broken: /' || true
fi
echo "transformers $want: $(tail -1 "$work/log")"
exit $rc
