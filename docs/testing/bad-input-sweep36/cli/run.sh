#!/bin/bash
# usage: run.sh "label" cmd args...   (env vars may be prefixed via env)
cd /tmp/hostile36-cli/fx
label="$1"; shift
out=$(mktemp); err=$(mktemp)
start=$(date +%s)
timeout ${T:-300} "$@" >"$out" 2>"$err" </dev/null
rc=$?
dur=$(( $(date +%s) - start ))
tb=$(grep -c "Traceback" "$err")
nout=$(wc -c <"$out"); nerr=$(grep -c . "$err")
first=$(grep -m1 -E "error|Error|Traceback|Invalid" "$err" | sed 's/[│╭╮╰╯─]//g;s/  */ /g')
[ -z "$first" ] && first=$(head -1 "$err")
flag=ok
[ $rc -eq 0 ] && flag=EXIT0
[ $tb -gt 0 ] && flag=TRACEBACK
[ $rc -ne 0 ] && [ $nout -gt 0 ] && flag="$flag+STDOUT"
[ $rc -eq 124 ] && flag=HANG
echo "[$flag rc=$rc ${dur}s outbytes=$nout err=$nerr] $label :: $first" | tee -a /tmp/hostile36-cli/cases.txt
if [ -n "$SHOW" ]; then echo "--- stdout"; head -${SHOW} "$out"; echo "--- stderr"; tail -${SHOW} "$err"; fi
cp "$out" /tmp/hostile36-cli/last.out; cp "$err" /tmp/hostile36-cli/last.err
rm -f "$out" "$err"
