#!/bin/bash
# As run in session 10 (2026-12-02) from /tmp/spread-plan, after the first plan run (plan-b0.0008-t0.9.json):
# q8's held-out KLD from that run becomes the budget of three --reuse runs (T = 0.9, 1.0, 0.8).
# waits for the first plan run, then reuses its sensitivities at q8's held-out KLD as the budget
cd /tmp/spread-plan
while pgrep -f "recipe-b0.0008-t0.9" > /dev/null; do sleep 10; done
Q8=$(/work/wt/spread/.venv/bin/python -c "
import json; d=json.load(open('plan-b0.0008-t0.9.json'))
print(next(r for r in d['rows'] if r['kv']=='q8')['kld_mean'])")
echo "q8 held-out KLD $Q8" > after.log
for T in 0.9 1.0 0.8; do
  nice -n 5 /work/wt/spread/.venv/bin/kvlens lab plan --model smollm2 --corpus hamlet_gut --kld-budget $Q8 --calib-target $T --calib-chunks 4 --calib-spread --ctx 256 --heldout-chunks 8 --prefill-chunk 32 --kv q8 --candidates q8h,q7h,q6h,q5h,q4h --json --out recipe-bq8-t$T.json --reuse plan-b0.0008-t0.9.json > plan-bq8-t$T.json 2>> after.log
  echo "T=$T done $(date -u)" >> after.log
done
