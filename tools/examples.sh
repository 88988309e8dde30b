#!/usr/bin/env bash
# Real examples for docs/tools.md: capture a short dgt train run, summarise it, and
# replay it at a second run (which must reject it). Needs root (capture). Usage:
#   sudo bash tools/examples.sh OUTDIR
set -euo pipefail
out=${1:-/tmp/dgt-examples}
mkdir -p "$out" && cd "$out"
A=47100; B=47200
run() { echo "\$ $*"; "$@"; echo; }
dgt capture --base-port $A --ranks 4 --udp-channels 3 -w a.pcap -q > capture.log 2>&1 &
cap=$!
sleep 2
run dgt train --epochs 1 --hidden 256 --seed 5 --base-port $A --report a.json
kill -TERM $cap; wait $cap || true
echo "\$ dgt capture --base-port $A --ranks 4 --udp-channels 3 -w a.pcap -q   (stopped by SIGTERM)"
cat capture.log; echo
run dgt pcap summary a.pcap --report a.json --plot a.png
dgt train --epochs 3 --hidden 256 --seed 5 --base-port $B --report b.json > b.log 2>&1 &
trainer=$!
while [ ! -s "$(ls -d /tmp/dgt-run-* 2>/dev/null | head -1)/endpoints-3.json" ] && kill -0 $trainer 2>/dev/null; do sleep 0.2; done
sleep 1
run dgt replay a.pcap --to 127.0.0.1 --base-port $B --from-base-port $A
wait $trainer
echo "\$ dgt train --epochs 3 --hidden 256 --seed 5 --base-port $B --report b.json   (while the replay ran)"
tail -n 14 b.log
