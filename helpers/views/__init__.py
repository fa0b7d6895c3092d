"""Every figure and widget of the notebooks, thin shells over pure functions that tests call.
`plot_*` returns a matplotlib Figure, `widget_*` returns an ipywidgets widget; the notebook displays."""
