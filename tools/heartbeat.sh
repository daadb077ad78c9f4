#!/usr/bin/env bash
# heartbeat.sh LABEL COMMAND...: run COMMAND, printing "  ... LABEL (N s)" every 5 s while it
# runs (pip prints nothing while it unpacks large wheels), and exit with its status.
set -u
label=$1; shift
"$@" &
pid=$!
start=$SECONDS
while kill -0 "$pid" 2>/dev/null; do
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        sleep 0.5
        kill -0 "$pid" 2>/dev/null || break 2
    done
    echo "  ... $label ($((SECONDS - start)) s)"
done
wait "$pid"
