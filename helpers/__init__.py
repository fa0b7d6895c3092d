"""Parallelism Lab helpers: the code the notebooks import, one folder per idea.

A topic (notebook 04's tensor parallelism, say) has up to four faces, each in its folder under
the topic's name:

    cost/<topic>      pure arithmetic: formulas, cost models, pure schedules (no torch)
    parallel/<topic>  blocks on any process group (group=None: the world); they start no
                      process and know nothing of the course's running example
    labs/<topic>      the notebook's runs: rank functions, runners on live ranks, one-process
                      references, comparisons with PyTorch's own pieces, tables
    views/<topic>     every figure and widget (plot_* returns a Figure, widget_* a widget)

Beside them: launch/ starts ranks (helpers.ranks and helpers.run are its public faces),
configs.py holds every model's configuration (torch-free), layout.py the one record of a 3-D
layout, models.py the models built from the configs, optimizers.py the one optimizer table,
parallel/trace.py the one event log every block reports to, simulator/ notebook 06's cost
model. The README's "The package" section maps every module; tests/test_architecture.py holds
the folders to these rules and that map to the files on disk.
"""
