#!/usr/bin/env bash
# Before/after numbers for the proposed server changes, without changing the
# package: each what-if (see sitecustomize.py here) is applied to the server
# process only, and P1 (logprobs answers, replayed upstream, K=64) runs with
# the raw proxy as its baseline in the same run. Prints one line per run.
#
#   benches/whatif/run.sh [REPEATS] [WHATIF ...]
#   benches/whatif/run.sh 3 "" inline freeze,notext,inline freeze,notext,process
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-$here/../../.venv/bin/python}"
repeats="${1:-3}"
shift || true
if [ "$#" -eq 0 ]; then set -- "" inline freeze,notext,inline freeze,notext,process; fi
for rep in $(seq "$repeats"); do
  for whatif in "$@"; do
    echo "== whatif=[${whatif}] repeat=${rep} load=$(cut -d' ' -f1-3 /proc/loadavg)"
    ROLLOUT_WHATIF="$whatif" PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" "$python" \
      "$here/../large_turns.py" --sessions 64 --rounds 4 --variants logprobs \
      --upstreams replay --targets server,raw --repeats 1 2>&1 | grep -E '^\| logprobs' | tail -4
  done
done
