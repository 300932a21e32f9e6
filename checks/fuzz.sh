#!/usr/bin/env bash
# Bad input by the thousand: the property-based tests (tests/test_fuzz_*.py) with hypothesis's
# thorough profile (tests/helpers/fuzz.py: ~1,000 examples a property, fewer where each
# example runs a script; a fixed seed, so a run repeats), then the tally of what the examples
# did, by kind of input: how many ran (read as they hold, or trained) and how many were
# refused in one line. A traceback or a silent wrong result fails the property, and this
# script with it: a table is printed only when there was none. docs/robustness.md holds the
# last table.
#
#   bash checks/fuzz.sh                      # about 5 minutes on 2 cores
#   bash checks/fuzz.sh -k idx               # pytest's arguments: one property
#
# Needs the test requirements (requirements-test.txt: hypothesis); a CPU; no network.
set -euo pipefail
cd "$(dirname "$0")/.."
TALLY=$(mktemp /tmp/fuzz_tally.XXXXXX)
start=$(date +%s)
# One thread a process: the examples are small, and the machine may have other work.
HYPOTHESIS_PROFILE=thorough FUZZ_TALLY="$TALLY" OMP_NUM_THREADS=1 \
  python -m pytest -q -p no:cacheprovider tests/test_fuzz_*.py "$@"
python - "$TALLY" "$(( $(date +%s) - start ))" <<'EOF'
import json, platform, sys

import hypothesis
import torch

table = json.load(open(sys.argv[1]))
print(f"\n{sum(sum(v.values()) for v in table.values()):,} inputs in {int(sys.argv[2]) // 60} min "
      f"(hypothesis {hypothesis.__version__}, torch {torch.__version__}, Python "
      f"{platform.python_version()}); 0 tracebacks, 0 silent wrong results\n")
print("| input | tried | ran | refused in one line |")
print("|---|--:|--:|--:|")
for kind, n in table.items():
    print(f"| {kind} | {n['ran'] + n['refused']:,} | {n['ran']:,} | {n['refused']:,} |")
EOF
