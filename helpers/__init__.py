"""Parallelism Lab helpers: the code the notebooks import, one idea per module.

00  hardware (GPU records, shared with the simulator), hierarchy, roofline
01  ranks (start and keep real ranks), collectives
02  bench (timing collectives), alpha_beta (the latency-bandwidth model)
03  mlp (the lecture's model), ddp (data-parallel wrappers), zero (ZeRO-1 optimizer)
04  tp (tensor parallelism), tp_cost (when it pays: compute vs communication per layer)
05  pp (running pipelines), pp_schedules (schedules, no processes), gantt (the chart)
06  simulator (the training-cost model)
Every notebook measures with `timing`; `run` starts the same rank functions under torchrun.
"""
