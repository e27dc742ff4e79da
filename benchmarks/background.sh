#!/usr/bin/env bash
# Benchmark commands run in turn in a background session, under one deadline, for machines where one remote command
# may run only minutes while a study takes longer: `start` returns at once and the commands go on after the command
# that started them has ended; `wait` (as often as needed) waits for them and packs what they wrote into one file.
#   bash benchmarks/background.sh start DIR DEADLINE_S 'command 1' 'command 2' ...
#       runs each command with bash from the current folder, in turn, each under `timeout` for what is left of
#       DEADLINE_S; its output goes to DIR/NN.log and a line "NN exit SECONDS command" to DIR/status; DIR/DONE when
#       all have run (or the deadline passed). The commands may write results anywhere under DIR (export RESULTS=DIR
#       is set for them). DIR must not exist yet.
#   bash benchmarks/background.sh wait DIR SECONDS [ARCHIVE.tgz]
#       waits up to SECONDS for DIR/DONE, then packs DIR into ARCHIVE (default DIR.tgz); exit 0 when all have run,
#       1 while they still run, 3 when DIR does not exist (on a fresh machine: nothing was started there).
set -uo pipefail
verb=${1:?usage: background.sh start DIR DEADLINE_S COMMAND... | wait DIR SECONDS [ARCHIVE]}
dir=${2:?DIR}
case "$verb" in
  start)
    deadline=${3:?DEADLINE_S}
    shift 3
    [ -e "$dir" ] && { echo "background.sh: $dir exists: give a new folder (nothing was started)" >&2; exit 2; }
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    printf '%s\n' "$@" > "$dir/commands"
    setsid nohup bash -c '
      dir=$1 deadline=$2; shift 2; end=$(( SECONDS + deadline )); n=0
      export RESULTS=$dir
      for command in "$@"; do
        n=$((n + 1)); left=$(( end - SECONDS )); log=$(printf "%s/%02d.log" "$dir" "$n")
        if [ "$left" -le 0 ]; then printf "%02d skipped 0 %s\n" "$n" "$command" >> "$dir/status"; continue; fi
        started=$SECONDS
        timeout -k 20 "$left" bash -c "$command" > "$log" 2>&1
        printf "%02d %d %d %s\n" "$n" "$?" $(( SECONDS - started )) "$command" >> "$dir/status"
      done
      touch "$dir/DONE"' bash "$dir" "$deadline" "$@" > /dev/null 2>&1 < /dev/null &
    echo "background.sh: $# command(s) started under $deadline s; results in $dir"
    ;;
  wait)
    seconds=${3:?SECONDS}
    archive=${4:-${dir%/}.tgz}
    [ -d "$dir" ] || { echo "background.sh: $dir does not exist: nothing was started on this machine" >&2; exit 3; }
    for _ in $(seq "$seconds"); do [ -f "$dir/DONE" ] && break; sleep 1; done
    tar -czf "$archive" -C "$(dirname "$dir")" "$(basename "$dir")"
    cat "$dir/status" 2>/dev/null
    [ -f "$dir/DONE" ] && exit 0
    echo "background.sh: still running (packed what is there so far into $archive)"
    exit 1
    ;;
  *) echo "background.sh: unknown verb $verb: start or wait" >&2; exit 2 ;;
esac
