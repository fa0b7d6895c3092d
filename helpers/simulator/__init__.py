"""The training-cost simulator of notebook 06: Erdil & Schneider-Joseph's model (2024).

Modules follow the spec (shared/specs/cost_model.md), one idea each:
`settings` and `config` (what a configuration is, as JSON, validated), `matmul` (§2),
`scaling` (§3), `comm` (§4), `reference` (§5–§6 transcribed directly), `placement` and
`search` (the same search, fast and bit-identical), `curve` (§7), `report` (the JSON
output) and `__main__` (the CLI). The notebook's figures, tables and app are in
`helpers.views.simulator`.

Notation: the spec's names stay in the code and in the CLI's JSON keys (`Model.d` is the model
width, `Model.s` the number of experts, `Model.P` the parameters, `Model.B` the tokens per
batch); printed text spells them out (width, experts, params, tokens per batch), because the
course uses d for the data-parallel degree and s for the sequence length.
"""
