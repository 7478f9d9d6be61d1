"""Generate in the parent, fork, generate in the child: how kvlens fares in a forked child.

python fork_child.py                                  # child killed: exit -15 (numba's GNU OpenMP)
NUMBA_THREADING_LAYER=workqueue python fork_child.py  # child hangs in torch's attention (stopped at 15 s)
"""

import faulthandler
import os

import kvlens

PROMPT = "The capital of France is"
m = kvlens.load("smollm2", kv="q8")
print("parent:", repr(m.generate(PROMPT, max_new_tokens=4)), flush=True)
pid = os.fork()
if pid == 0:
    faulthandler.dump_traceback_later(15, exit=True)  # a hang prints where it is stuck, then exits 1
    print("child:", repr(m.generate(PROMPT, max_new_tokens=4)), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exit:", os.waitstatus_to_exitcode(status))
