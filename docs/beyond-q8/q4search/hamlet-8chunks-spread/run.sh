#!/bin/bash
# Session 13: eight spread calibration chunks (the 1st, 3rd, ... of the first 16), eight held out.
cd /tmp/calib8
V=/work/wt/calib8/.venv/bin/kvlens
date -u > times.txt
nice -n 19 $V lab plan --model smollm2 --corpus hamlet_gut --kld-budget 0.0008 --calib-target 0.9 --calib-chunks 8 --calib-spread --ctx 256 --heldout-chunks 8 --prefill-chunk 32 --kv q8 --candidates q8h,q7h,q6h,q5h,q4h --json --out recipe-b0.0008-t0.9.json > plan-b0.0008-t0.9.json 2> plan.err
echo "first done rc=$? $(date -u)" >> times.txt
Q8=$(/work/wt/calib8/.venv/bin/python -c "
import json; d=json.load(open('plan-b0.0008-t0.9.json'))
print(next(r for r in d['rows'] if r['kv']=='q8')['kld_mean'])")
echo "q8 held-out KLD $Q8" >> times.txt
for T in 0.9 1.0 0.8; do
  nice -n 19 $V lab plan --model smollm2 --corpus hamlet_gut --kld-budget $Q8 --calib-target $T --calib-chunks 8 --calib-spread --ctx 256 --heldout-chunks 8 --prefill-chunk 32 --kv q8 --candidates q8h,q7h,q6h,q5h,q4h --json --out recipe-bq8-t$T.json --reuse plan-b0.0008-t0.9.json > plan-bq8-t$T.json 2>> after.log
  echo "T=$T done rc=$? $(date -u)" >> times.txt
done
