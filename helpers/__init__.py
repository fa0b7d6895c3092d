"""Parallelism Lab helpers: the code the notebooks import, one folder per idea.

    ranks.py, run.py   what readers import and run: LiveRanks, spawn (ranks.py); `python -m helpers.run` (run.py)
    launch/            how ranks are launched, by concern: both files above only re-export from here
        host.py          cores, memory, GPUs, threads per rank, the backend, loopback pinning, intra_op_threads
        checks.py        spawn's and LiveRanks' argument checks     errors.py  RankError, RankTimeoutError
        worker.py        the rank side and the launcher that forks ranks
        process.py       rank processes: start, kill, reap, interrupts held back, private folders
        live.py          LiveRanks, the cap on live ranks, exit-signal clean-up, spawn
        torchrun.py      the same functions under torchrun: the demos, and notebook 07's train3d
    models.py          the course's models: the lecture's MLP (MLPConfig), 07's small GPT, 09's MoE; losses
    checks.py          argument checks with one wording, run before any process starts
    exercises.py       the notebooks' checked exercises: check_* says right or wrong, and why
    parallel/          rank-side building blocks, each on any process group (group=None: the world)
        groups.py        rank device, sub-groups, group vs global ranks, collective shims, the portable mean
        collectives.py   the eight collectives (01)         dp.py      DDP wrappers, naive to bucketed (03)
        zero.py          ZeRO-1 sharded optimizer (03), ZeRO stages 0-2 on flat buckets (08)
        tp.py            f/g, column/row-parallel layers (04)   bench.py  one collective timed on a group (02)
        pp.py            pipelines on live ranks (05)        schedules.py  GPipe / 1F1B / interleaved plans
        mesh.py          the (d, t, p) mesh of notebook 07      tp_transformer.py  attention heads split over t
        parallel3d.py    DP × TP × PP on the transformer (07)   layouts.py  calibrating and timing layouts (07)
        fsdp.py          ZeRO-3 / FSDP from scratch, per unit, optional prefetch (08)
        memory.py        what a rank holds: state bytes, saved activations, profiler peak, collective bytes (08)
        memory_run.py    notebook 08's runs: each ZeRO stage trained and measured, FSDP2, checkpointing
        experts.py       expert parallelism: MoE over all-to-all (09)   ring_attention.py  context parallelism (09)
    cost/              pure arithmetic, no torch, no processes
        alpha_beta.py    the one α–β model of a collective, and its fit   tp.py   when tensor parallelism pays
        memory.py        ZeRO memory per rank, activations, communication volume (03, 08)
        bubble.py        the pipeline bubble     roofline.py   the roofline     bench.py  02's sizes, fits, tables
        parallel3d.py    a 3-D layout's step time from calibrated equations (07)
        experts.py       expert capacity, all-to-all bytes    context.py  ring bytes, causal work per rank, ring idle (09)
    hardware.py        GPU records (notebook 00 and the simulator share them); hierarchy.py their table
    timing.py, roofline.py   measuring: one measurement line, this machine's roofs
    simulator/         Epoch AI's training-cost model (notebook 06) and its command line
    views/             every figure and widget, one module per core module (views/tp.py draws parallel/tp.py
                       and cost/tp.py); `plot_*` returns a Figure, `widget_*` returns a widget, the notebook shows it
        kit.py           what every view shares: figures as PNG bytes (once, or blitted), notebook outputs,
                         plain-text log ticks and pinned labels (cheap redraws), human_bytes, FULL_LABEL
        simulator/       notebook 06's, by concern: configuration.py (the record, presets, form values),
                         figures.py, summary.py (words and tables), app.py (SimulatorApp, widget_simulator)

Nothing outside views/ imports matplotlib or ipywidgets (tests/test_layout.py checks it).
"""
