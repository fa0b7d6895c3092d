"""Parallelism Lab helpers: the code the notebooks import.

One module per idea: `ranks` starts and keeps processes, `collectives` shows what each
collective does, `hardware` describes GPUs, and the later modules (bench, ddp, zero, tp,
pp, simulator) follow the notebooks in order.
"""
