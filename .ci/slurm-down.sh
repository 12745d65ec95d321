#!/usr/bin/env bash
# Stop what .ci/slurm-up.sh started, by the pids it recorded under $PB_SLURM_DIR: slurmd, slurmctld,
# slurmdbd, MariaDB, munged (in that order), each TERM then, after 20 s, KILL. Leaves the packages,
# the configs and $PB_SLURM_DIR (logs) in place.
set -uo pipefail
DIR=${PB_SLURM_DIR:-/tmp/posterior-bench-slurm}
stop() {  # stop <name> <pid file>
    local name=$1 file=$2 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -0 "$pid" 2>/dev/null && { echo "slurm-down: $name (pid $pid) ignored TERM: KILL" >&2; kill -KILL "$pid"; }
        echo "slurm-down: stopped $name (pid $pid)" >&2
    fi
    rm -f "$file"
}
stop slurmd "$DIR/run/slurmd.pid"
stop slurmctld "$DIR/run/slurmctld.pid"
stop slurmdbd "$DIR/run/slurmdbd.pid"
stop mariadbd "$DIR/run/mariadbd.pid"
stop munged "$DIR/run/munged.pid"
[ -d "$DIR" ] && echo "stopped by .ci/slurm-down.sh" > "$DIR/status"
exit 0
