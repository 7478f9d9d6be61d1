#!/bin/bash
# kill mutmut's children that have run past 150 s (deadlocked: RLIMIT_CPU never fires for a sleeping child)
P=$1
while kill -0 $P 2>/dev/null; do
  ps -o pid=,etimes=,args= --ppid $P | while read pid et args; do
    case "$args" in "mutmut: "*) if [ "$et" -gt 45 ]; then echo "$(date -u +%T) HUNG $args" >> /tmp/mut42/hung.txt; kill -s XCPU $pid; sleep 2; kill -9 $pid 2>/dev/null; fi;; esac
  done
  sleep 15
done
