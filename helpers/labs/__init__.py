"""Each notebook's runs, one module per topic: rank functions, runners on live ranks, the
single-process references they are checked against, comparisons with PyTorch's own pieces, and
tables. A lab composes the topic's blocks (`helpers.parallel.<topic>`) with the course's running
example and the launcher; `helpers.views.<topic>` draws what it returns."""
