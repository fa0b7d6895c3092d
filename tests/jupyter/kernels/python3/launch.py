"""make test's notebook kernel: ipykernel, started at a lower priority than the unit tests.

`make test` runs the unit tests, nbval and the browser tests side by side on 2 cores. Every kernel starts in a
session of its own, and where Linux groups the scheduler by session (autogroup), each kernel with
its ranks gets as much CPU as all the unit tests together, whatever `nice` says: the unit tests,
the longest suite, were starved, then ran alone at the end. Writing a nice value to
/proc/self/autogroup lowers this kernel's session as a whole (nice is inherited by its ranks too).
Make points nbval and the browser's JupyterLab here with JUPYTER_PATH=tests/jupyter and sets the
value in PLAB_SESSION_NICE: 2 (at 5 the kernels' ranks were starved: one call of notebook 02's
sweep took over its 60 s limit).
"""
import os
import runpy
import sys

NICE = int(os.environ.get("PLAB_SESSION_NICE", "0"))
if NICE > 0:
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write(str(NICE))
    except OSError:   # no autogroup here: the nice inherited from make is what counts
        pass
sys.argv[0] = "ipykernel_launcher"
runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
