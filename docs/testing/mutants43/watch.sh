#!/bin/bash
# end mutmut's children that have run past 240 s (deadlocked: RLIMIT_CPU never fires for a sleeping child);
# SIGXCPU first, which mutmut reads as a timeout. Usage: watch.sh <pid of "mutmut run">
P=$1
while kill -0 $P 2>/dev/null; do
  ps -o pid=,etimes=,args= --ppid $P | while read pid et args; do
    case "$args" in "mutmut: "*) if [ "$et" -gt 240 ]; then echo "$(date -u +%T) HUNG $args" >> /tmp/mut43/hung.txt; kill -s XCPU $pid; sleep 2; kill -9 $pid 2>/dev/null; fi;; esac
  done
  sleep 15
done
