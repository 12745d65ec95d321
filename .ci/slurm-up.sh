#!/usr/bin/env bash
# Start a single-node SLURM on this machine from Debian's packages (issue 38): munge, MariaDB,
# slurmdbd (submitit polls sacct, which reads the accounting database), slurmctld and slurmd, each
# started here as a plain process (no systemd) with its pid file under $PB_SLURM_DIR; .ci/slurm-down.sh
# stops them by those pids. Needs root (Debian's slurm runs as root here: SlurmUser=root). No cgroups:
# ProctrackType=proctrack/linuxproc, TaskPlugin=task/affinity. The node is this machine (its CPUs and
# memory as slurmd -C reports them), one partition `debug`.
#
#   .ci/slurm-up.sh            # installs the packages if missing (apt-get), writes the configs, starts, waits
#   PB_SLURM_INSTALL=0 ...     # do not install: fail if the packages are missing
#
# Exit status 0 when `sinfo` shows the node idle and `sacct` answers; otherwise non-zero with the
# reason on stderr (and in $PB_SLURM_DIR/status). The config goes to /etc/slurm/slurm.conf, which it
# refuses to replace unless it wrote it (the marker line below).
set -euo pipefail

DIR=${PB_SLURM_DIR:-/tmp/posterior-bench-slurm}
MARKER="# written by posterior-bench .ci/slurm-up.sh"
CONF=/etc/slurm/slurm.conf
DBD_CONF=/etc/slurm/slurmdbd.conf
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)
DB_PORT=${PB_SLURM_DB_PORT:-3306}
started=$(date +%s)

say() { echo "slurm-up: $*" >&2; }
fail() { say "$*"; mkdir -p "$DIR" && echo "failed: $*" > "$DIR/status"; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (Debian's SLURM daemons, /etc/slurm)"
mkdir -p "$DIR"/{log,ctld,spool,run,mysql}
rm -f "$DIR/status"

missing=()
for p in "${PACKAGES[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
    [ "${PB_SLURM_INSTALL:-1}" = 1 ] || fail "packages missing: ${missing[*]} (PB_SLURM_INSTALL=0)"
    say "installing ${missing[*]}"
    # no service may start during the installation: this script starts each daemon itself
    policy=/usr/sbin/policy-rc.d
    own_policy=0
    if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' > $policy && chmod +x $policy && own_policy=1; fi
    ok=1
    { timeout 600 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq \
        --no-install-recommends "${missing[@]}"; } > "$DIR/log/apt.log" 2>&1 || ok=0
    [ $own_policy = 1 ] && rm -f $policy
    [ $ok = 1 ] || fail "apt-get install ${missing[*]} failed (see $DIR/log/apt.log): $(tail -n 3 "$DIR/log/apt.log" | tr '\n' ' ')"
    say "installed in $(( $(date +%s) - started )) s"
fi

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for <seconds> <what> <command...>
    local limit=$1 what=$2; shift 2
    for _ in $(seq $((limit * 5))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
    fail "$what did not come up in ${limit} s (logs: $DIR/log)"
}

# --- munge
if ! running "$DIR/run/munged.pid"; then
    mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
    [ -s /etc/munge/munge.key ] || { mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null ||
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; }
    chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge
    chmod 0700 /etc/munge && chmod 0600 /etc/munge/munge.key
    touch "$DIR/log/munged.log" && chown munge:munge "$DIR/log/munged.log"
    runuser -u munge -- munged --pid-file=/run/munge/munged.pid --log-file="$DIR/log/munged.log" \
        || fail "munged did not start (see $DIR/log/munged.log)"
    wait_for 10 munged test -s /run/munge/munged.pid
    cp /run/munge/munged.pid "$DIR/run/munged.pid"
fi
wait_for 10 "munge" sh -c 'munge -n | unmunge'

# --- MariaDB (its own data folder under $DIR, TCP on 127.0.0.1 only)
if ! running "$DIR/run/mariadbd.pid"; then
    if [ ! -d "$DIR/mysql/mysql" ]; then
        mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql" --auth-root-authentication-method=socket \
            > "$DIR/log/mariadb-install.log" 2>&1 || fail "mariadb-install-db failed (see $DIR/log/mariadb-install.log)"
    fi
    (setsid mariadbd --no-defaults --user=root --datadir="$DIR/mysql" --socket="$DIR/run/mysql.sock" \
        --pid-file="$DIR/run/mariadbd.pid" --bind-address=127.0.0.1 --port="$DB_PORT" \
        --innodb-buffer-pool-size=128M --innodb-lock-wait-timeout=900 --log-error="$DIR/log/mariadb.log" </dev/null >/dev/null 2>&1 &)
    wait_for 60 MariaDB mariadb --no-defaults --socket="$DIR/run/mysql.sock" -uroot -e 'select 1'
    mariadb --no-defaults --socket="$DIR/run/mysql.sock" -uroot -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'pbench';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'pbench';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" || fail "could not create the accounting database's user"
fi

# --- configs
host=$(hostname -s)
mkdir -p /etc/slurm
for f in $CONF $DBD_CONF; do
    if [ -e $f ] && ! grep -qF "$MARKER" $f; then
        fail "$f exists and was not written by this script: a SLURM is configured here already (left alone)"
    fi
done
node=$(slurmd -C | head -n 1)   # NodeName=<host> CPUs=.. Boards=.. SocketsPerBoard=.. ... RealMemory=..
memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node")
memory=$((memory * 9 / 10))     # leave room for the daemons
node=$(sed -e "s/RealMemory=[0-9]*/RealMemory=$memory/" -e "s/^NodeName=[^ ]*/NodeName=$host NodeAddr=127.0.0.1/" <<<"$node")
cat > $CONF <<CONF
$MARKER
ClusterName=pbench
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${PB_SLURM_CTLD_PORT:-6817}
SlurmdPort=${PB_SLURM_D_PORT:-6818}
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=${PB_SLURM_DBD_PORT:-6819}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=10
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
$node State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
cat > $DBD_CONF <<CONF
$MARKER
AuthType=auth/munge
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=${PB_SLURM_DBD_PORT:-6819}
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=pbench
StorageLoc=slurm_acct_db
CONF
chmod 600 $DBD_CONF

# --- slurmdbd, slurmctld, slurmd
if ! running "$DIR/run/slurmdbd.pid"; then
    slurmdbd || fail "slurmdbd did not start (see $DIR/log/slurmdbd.log)"
fi
wait_for 60 slurmdbd sacctmgr -i list cluster
sacctmgr -i -Q add cluster pbench >/dev/null 2>&1 || true
if ! running "$DIR/run/slurmctld.pid"; then
    slurmctld || fail "slurmctld did not start (see $DIR/log/slurmctld.log)"
fi
wait_for 60 slurmctld scontrol ping
if ! running "$DIR/run/slurmd.pid"; then
    slurmd || fail "slurmd did not start (see $DIR/log/slurmd.log)"
fi
idle() { sinfo -h -N -o '%T' | grep -qE '^(idle|mixed|allocated)'; }
wait_for 60 "the node (sinfo: $(sinfo -h -N -o '%N %T %E' 2>&1 | tr '\n' ' '))" idle
wait_for 30 sacct sacct -n -X -S now-1minute
echo "up in $(( $(date +%s) - started )) s" > "$DIR/status"
say "SLURM up in $(( $(date +%s) - started )) s: $(sinfo -h -N -o '%N %c CPUs %m MB %T')"
