#!/usr/bin/env bash
# The project's test command (README, `pixi run test`, CI):
#   1. the kit's own tests (Triton kernels under the interpreter when there is no GPU);
#   2. OpenFold3's whole suite with the kit active and nothing forced (must match
#      stock OF3), then the files that exercise what the kit replaces with every
#      extension forced on (kernels under the interpreter: a time-boxed subset).
# Prints one combined summary line and exits non-zero on any failure or on a run
# that collected no test.
set -uo pipefail
cd "$(dirname "$0")/.."
reports="$(mktemp -d)"
trap 'rm -rf "$reports"' EXIT
status=0

python -m pytest tests -q -p no:cacheprovider --timeout=900 \
    --junitxml="$reports/kit.xml" || status=1
of3-megafold test-of3 --extensions none -q --timeout=900 \
    --junitxml="$reports/of3-none.xml" || status=1
of3-megafold test-of3 --subset ci --extensions all -q --timeout=900 \
    --junitxml="$reports/of3-all.xml" || status=1

python scripts/summarize_junit.py "$reports"/*.xml || status=1
exit "$status"
