#!/bin/bash
# Serving speed of two checkouts of tokenmill side by side, in one run: both servers stay up
# (an idle one takes no CPU) and each point goes to one after the other, twice, so slow drift
# of the machine lands on both. For a refactor that must not change speed:
#
#   git worktree add /tmp/old <old commit>
#   benchmarks/old_vs_new.sh /tmp/old . /tmp/ab      # then compare /tmp/ab/*.txt
#
# Points: random 128 in / 128 out, 32 prompts, concurrency 8; 128 / 64, 8 prompts, one at a
# time; greedy, ignore_eos. /server_info of each is saved beside (dtype, CPU step, plan).
set -u
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd); OUT=${3:-/tmp/old_vs_new}
PY=${PYTHON:-python3}; MODEL=smollm2-135m-instruct
mkdir -p "$OUT"

start() {  # name, checkout, port: wait until /health answers
  (cd /tmp && PYTHONPATH=$2 $PY -m tokenmill.cli serve $MODEL --port $3 > "$OUT/$1.log" 2>&1 &)
  for _ in $(seq 1 300); do curl -sf localhost:$3/health > /dev/null && return 0; sleep 1; done
  echo "$1 did not start; see $OUT/$1.log" >&2; return 1
}

bench() {  # name, port, tag, bench flags...
  local name=$1 port=$2 tag=$3; shift 3
  $PY -m tokenmill.cli bench serve --base-url http://127.0.0.1:$port --model $MODEL \
    --ignore-eos --temperature 0 --no-progress --result-file "$OUT/$name-$tag.json" "$@" \
    > "$OUT/$name-$tag.txt" 2>&1
}

start old "$OLD" 8101 && start new "$NEW" 8102 || exit 1
for name in old new; do
  port=$([ $name = old ] && echo 8101 || echo 8102)
  curl -s localhost:$port/server_info > "$OUT/$name-info.json"
done
for round in 1 2; do
  for name in old new; do
    port=$([ $name = old ] && echo 8101 || echo 8102)
    bench $name $port r$round-c8 --workload random --num-prompts 32 --input-len 128 \
      --output-len 128 --max-concurrency 8 --seed $round --warmup 2
    bench $name $port r$round-c1 --workload random --num-prompts 8 --input-len 128 \
      --output-len 64 --max-concurrency 1 --seed $((10 + round)) --warmup 1
  done
done
pkill -f "tokenmill.cli serve $MODEL --port 810[12]"
for f in "$OUT"/*-r?-c?.txt; do
  printf '%-40s %s\n' "$(basename "$f" .txt)" \
    "$(grep -h 'Output token throughput\|TPOT median' "$f" | awk '{printf "%s  ", $NF}')"
done
