#!/usr/bin/env bash
# The benchmarks of jaxlod's loop plans on one accelerator, in one command.
#
#   benchmarks/accelerator.sh [OUTPUT_DIR]          # on the accelerator
#   benchmarks/accelerator.sh --smoke OUTPUT_DIR    # end to end, tiny, any backend
#
# Runs, one after another, each in its own process, the figures that matter
# most first:
#   rnn.py             --candidates on W1, W2 and W3 (every loop plan
#                      candidate beside jaxlod, the baselines and cuDNN),
#                      and the fused Pallas kernel's arm, jaxlod_fused,
#                      which rnn.py always runs (issue 54: its times against
#                      cuDNN's and its compile time against Flax padded to
#                      the capacity, in each workload's `fused`)
#   scan.py            the minGRU step with linear_scan against padded scans
#                      and dynamic_rnn on W1 and W3 (issue 56)
#   decode_corpus.py   continuous refill against per-batch decoding of the
#                      G2P test set (issue 55), 256 slots, chunks of 4 steps
#   decode.py          --plan default,cpu (the backend's plan and the ladder
#                      of before, side by side)
#   attention.py       the backend's plan
#   sequence_attention.py  self-attention inside each sequence against Flax
#                      padded, on W1's and W2's lengths (issue 65)
#   sweep.py           a reduced grid of the drop-in RNN against padding
#                      (issue 66): batch 8 and 128, time 16 and 256, hidden
#                      256, even and log-normal lengths, the cheapest first
#   g2p_throughput.py  --plan cpu,default on the `fast` shape: before and
#                      after in the same rounds
# and writes NAME.json into OUTPUT_DIR (default: benchmarks/results/DEVICE/,
# DEVICE being jax.devices()[0].device_kind lowercased, spaces as `_`, e.g.
# nvidia_h200), each script's progress (stderr) into OUTPUT_DIR/logs/. It
# prints each script's wall time and the total, and exits non-zero when a
# script failed, ran out of time or was skipped; the others still run.
#
# Time: the whole run stays within ACCELERATOR_BUDGET_S seconds (default
# 560, under the device's 10 minutes a command): each script gets at most
# its own share (rnn 250 s, scan 60 s, decode_corpus 70 s, decode 50 s,
# attention 40 s, sequence_attention 50 s, sweep 40 s, g2p_throughput what
# is left) and at most what is left of the budget, and is stopped
# (`timeout`) past it; rnn.py rewrites its JSON after each workload and
# sweep.py after each cell, so a stopped run keeps those it finished. A
# script left under 30 s is skipped.
#
# --smoke (or ACCELERATOR_SMOKE=1): every script at its smallest (rnn.py's
# tiny workload S, one repeat or round) with the accelerator's plan forced
# (`--plan accelerator` where the full run passes `default`), no time limit;
# OUTPUT_DIR is required. For checking the whole run on a CPU first (where
# jaxlod_fused runs in Pallas's interpret mode: it checks, it does not time).
#
# Uses `python3` from PATH (PYTHON=... to choose another) from the repository
# root; installs nothing.
set -euo pipefail

usage() {
  sed -n '2,5p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

smoke=${ACCELERATOR_SMOKE:-0}
while (($#)); do
  case $1 in
    --smoke) smoke=1; shift ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    -*) echo "accelerator.sh: unknown option $1" >&2; usage >&2; exit 2 ;;
    *) break ;;
  esac
done
if (($# > 1)); then
  usage >&2
  exit 2
fi
out=${1:-}
if [[ $smoke == 1 && -z $out ]]; then
  echo "accelerator.sh: --smoke needs an output directory" >&2
  exit 2
fi
PYTHON=${PYTHON:-python3}
if ! command -v "$PYTHON" >/dev/null; then
  echo "accelerator.sh: no Python at '$PYTHON' (set PYTHON=...)" >&2
  exit 2
fi
start_ms=$(date +%s%3N) # the budget counts from here
if [[ -n $out ]]; then # relative to where the command was given
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ -z $out ]]; then
  device=$("$PYTHON" -c '
import re, jax
kind = jax.devices()[0].device_kind.lower().replace(" ", "_")
print(re.sub(r"[^a-z0-9_.-]+", "_", kind))')
  out=$PWD/benchmarks/results/$device
  mkdir -p "$out"
fi
logs=$out/logs
mkdir -p "$logs"

if [[ $smoke == 1 ]]; then
  budget=${ACCELERATOR_BUDGET_S:-86400}
  default=accelerator # the accelerator's plan, forced
  rnn=(--workloads S --candidates --repeats 1)
  decode=(--repeats 1)
  g2p=(--arms 0 --rounds 1 --steps 2)
  attention=(--repeats 1)
  corpus=(--train-steps 1 --repeats 1 --slots 16 --refill 8)
  seqattn=(--workloads S --repeats 1)
  scan=(--workloads S --repeats 1)
  sweep=(--batches 8 --times 8 --hiddens 16 --profiles even --plans ladder --repeats 1)
  caps=(0 0 0 0 0 0 0 0) # no limit
else
  budget=${ACCELERATOR_BUDGET_S:-560}
  default=default
  rnn=(--workloads W1,W2,W3 --candidates --repeats 10)
  decode=(--repeats 5)
  g2p=(--arms 0 --rounds 3 --steps 40)
  attention=(--repeats 5)
  corpus=(--repeats 5 --slots 256 --refill 128 --chunk 4)
  seqattn=(--workloads W1,W2 --repeats 3)
  scan=(--workloads W1,W3 --repeats 10)
  sweep=(--batches 8,128 --times 16,256 --hiddens 256 --profiles even,lognormal
    --plans ladder,bodies1,hoist --repeats 3)
  caps=(250 60 70 50 40 50 40 0) # 0: what is left
fi
min_s=30
failed=()
summary=$logs/summary.txt
: >"$summary"

elapsed_s() { echo $((($(date +%s%3N) - start_ms) / 1000)); }

# run_script NAME CAP ARGS...: `python -m benchmarks.NAME ARGS --json
# OUT/NAME.json` within CAP seconds (0: no cap of its own) and the budget.
run_script() {
  local name=$1 cap=$2
  shift 2
  local left=$((budget - $(elapsed_s)))
  local limit=$left
  if ((cap > 0 && cap < limit)); then
    limit=$cap
  fi
  if ((limit < min_s)); then
    printf '%-16s skipped: %d s left of the %d s budget\n' "$name" "$left" "$budget" |
      tee -a "$summary"
    failed+=("$name (skipped)")
    return 0
  fi
  echo "== $name (at most ${limit} s): $PYTHON -m benchmarks.$name $*" >&2
  local t0 rc wall
  t0=$(date +%s%3N)
  set +e
  timeout --kill-after=10 "$limit" "$PYTHON" -m "benchmarks.$name" "$@" \
    --json "$out/$name.json" 2>&1 >/dev/null | tee "$logs/$name.log" >&2
  rc=${PIPESTATUS[0]}
  set -e
  wall=$(($(date +%s%3N) - t0))
  local status=ok
  if ((rc == 124 || rc == 137)); then
    status="stopped at ${limit} s"
  elif ((rc != 0)); then
    status="failed (exit $rc)"
  fi
  if [[ $status != ok ]]; then
    failed+=("$name ($status)")
  fi
  printf '%-16s %4d.%03d s  %s\n' "$name" $((wall / 1000)) $((wall % 1000)) "$status" |
    tee -a "$summary"
}

run_script rnn "${caps[0]}" --plan "$default" "${rnn[@]}"
run_script scan "${caps[1]}" "${scan[@]}"
run_script decode_corpus "${caps[2]}" "${corpus[@]}"
run_script decode "${caps[3]}" --plan "$default,cpu" "${decode[@]}"
run_script attention "${caps[4]}" --plan "$default" "${attention[@]}"
run_script sequence_attention "${caps[5]}" "${seqattn[@]}"
run_script sweep "${caps[6]}" "${sweep[@]}"
run_script g2p_throughput "${caps[7]}" --plan "cpu,$default" "${g2p[@]}"

total=$(($(date +%s%3N) - start_ms))
printf '%-16s %4d.%03d s  (budget %d s)\n' total $((total / 1000)) $((total % 1000)) \
  "$budget" | tee -a "$summary"
echo "JSON in $out; logs in $logs" >&2
if ((${#failed[@]})); then
  printf 'not complete: %s\n' "${failed[@]}" | tee -a "$summary" >&2
  exit 1
fi
