#!/usr/bin/env bash
# The serving check in two rounds per level in mirrored order (ar, auto, llama-server; then llama-server, auto, ar), pooled
# (bench-serve --pool), run from the repository's root: our ar and auto servers stay up; llama-server restarted before each of its runs; our
# servers drop their prefix cache and earlier answers before each run (--reset)
set -u
P=benchmarks/prompts
OUT=${OUT:-serve-check}
mkdir -p "$OUT"
M=qwen2.5-coder-1.5b-instruct
LS=${LLAMA_SERVER:-llama-server}  # built from llama.cpp's sources
G=$HOME/.cache/hydraspec/gguf/$M.gguf
port_free() { ! ss -ltn | grep -q ":$1 "; }
wait_up() { for i in $(seq 600); do curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; sleep 1; done; return 1; }
chats() { hydraspec bench-serve --url http://127.0.0.1:$1 --model $M $3 --prompts $P/multiturn.jsonl --skip 8 --limit 8 --turns 3 --concurrency $4 --label "$2" --out $OUT/chat $5; }
cold() { hydraspec bench-serve --url http://127.0.0.1:$1 --model $M $3 --prompts $P/everyday.jsonl --skip 6 --limit 1 --turns 1 --concurrency $4 --label "$2" --out $OUT/cold $5; }
llama() { $LS -m $G -t 2 -tb 2 -np 8 -c 32768 --port 8112 > $OUT/llama-$1-$2-$3.log 2>&1 &
  pid=$!; wait_up 8112; kill -0 $pid || exit 1
  $1 8112 "llama-server" "" $2 "$4"
  kill $pid; wait $pid; }
echo "== start $(date -u +%T) $(git log -1 --format=%h)"
port_free 8111 && port_free 8113 && port_free 8112 || { echo "ports busy"; exit 1; }
hydraspec serve --model $M --method ar --port 8111 > $OUT/serve-ar.log 2>&1 &
par=$!; wait_up 8111; kill -0 $par || exit 1
hydraspec serve --model $M --port 8113 > $OUT/serve-auto.log 2>&1 &
pau=$!; wait_up 8113; kill -0 $pau || exit 1
for c in 1 2 4 8; do
  for w in chats cold; do
    echo "== level $c $w round 1 $(date -u +%T)"
    $w 8111 "hydraspec ar" --reset $c ""
    $w 8113 "hydraspec auto" --reset $c ""
    llama $w $c 1 ""
    echo "== level $c $w round 2 $(date -u +%T)"
    llama $w $c 2 --pool
    $w 8113 "hydraspec auto" --reset $c --pool
    $w 8111 "hydraspec ar" --reset $c --pool
  done
done
kill $par $pau; wait
echo "== end $(date -u +%T)"
