#!/bin/sh
# The linger.py variants, one after another (one thread); output: linger.txt
cd "$(dirname "$0")"
export NUMBA_NUM_THREADS=1
py=${PYTHON:-python}
date -u +%H:%M:%S
$py linger.py none,f16,q8,q8-k,q8-v,q4,bf16,f32
$py linger.py f16,q8 --other-cpu
$py linger.py f16,q8,q8@int16
$py linger.py f16,q8 --between sleep
$py linger.py f16,q8 --between evict
$py linger.py f16,q8 --between zclear
$py linger.py f16,q8 --ftz
date -u +%H:%M:%S
