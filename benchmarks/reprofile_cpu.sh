#!/usr/bin/env bash
# Re-profile the shipped CPU profiles on a QUIET machine (nothing else running): profiles/cpu/tiny.json and
# small.json, with the commands of profiles/cpu/README.md at 5 repeats a point (docs/estimator.md, "Where a
# generation's time goes"). About 5 minutes on 2 quiet cores; ONLY=tiny (about 2 minutes) re-profiles tiny alone.
# Then: git diff --stat profiles/cpu && git commit -am "profiles/cpu: re-profiled on the quiet machine".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
echo "before: $(uptime)"
$PY -m realloc profile --model tiny --device cpu --tp 1,2 --repeats 5 --quiet --out profiles/cpu/tiny.json
if [ "${ONLY:-}" != tiny ]; then
  $PY -m realloc profile --model small --device cpu --tp 1,2 --batch-sizes 1,2,4,8,16,32 --seq-lens 8,16,32,64,128 \
    --ctx-lens 8,16,32,64,128,256 --repeats 5 --quiet --out profiles/cpu/small.json
fi
echo "after: $(uptime)"
