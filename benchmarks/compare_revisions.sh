#!/usr/bin/env bash
# Before/after of a change: benchmarks/compare_revisions.sh BEFORE_REV [AFTER_REV] [ROUNDS]
# Checks both revisions out as git worktrees, then runs every round's benchmarks on BEFORE and on
# AFTER back to back (alternated, so both see the same machine), writing one JSON line per run to
# $OUT (default ./bench-compare/) as KIND-before-R.json / KIND-after-R.json. Quote medians.
set -euo pipefail
before=${1:?usage: compare_revisions.sh BEFORE_REV [AFTER_REV] [ROUNDS]}
after=${2:-HEAD}
rounds=${3:-3}
root=$(git rev-parse --show-toplevel)
py=${PYTHON:-$root/.venv/bin/python}
out=${OUT:-$root/bench-compare}
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/before" 2>/dev/null; git -C "$root" worktree remove --force "$work/after" 2>/dev/null; rm -rf "$work"' EXIT
git -C "$root" worktree add -q --detach "$work/before" "$before"
git -C "$root" worktree add -q --detach "$work/after" "$after"
mkdir -p "$out"
export OMP_WAIT_POLICY=PASSIVE
for r in $(seq 1 "$rounds"); do
  for side in before after; do
    cd "$work/$side"
    PYTHONPATH=$PWD "$py" benchmarks/train_throughput.py --json --configs ours_async ours_sync ours_local --repeats 1 > "$out/train-$side-$r.json"
    PYTHONPATH=$PWD "$py" benchmarks/ps_throughput.py --json --skip-core --repeats 5 > "$out/ps-$side-$r.json"
    PYTHONPATH=$PWD "$py" benchmarks/serving.py --json > "$out/serving-$side-$r.json"
    echo "round $r $side done"
  done
done
