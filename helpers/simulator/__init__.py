"""The training-cost simulator of notebook 06: Erdil & Schneider-Joseph's model (2024).

The model is written out in docs/cost_model.md (Erdil & Schneider-Joseph, *Data movement
limits to frontier model training*, arXiv:2411.01137). Modules, one idea each:
`settings` and `config` (what a configuration is, as JSON, validated), `matmul` (one matmul on
one GPU), `scaling` (the scaling laws), `comm` (communication on a hierarchical network),
`reference` (one step and the search, transcribed plainly), `machine` (a GPU and its network
read once into the hashable records the search carries), `placement` and `search` (the same
search, fast and bit-identical), `curve` (the curve and its summary points), `report` (the
JSON output), `gtx580` (the GTX 580 question against Epoch AI's published answer),
`this_machine` (a rank of this machine's emulated cluster as the model's GPU record) and
`__main__` (the CLI). The notebook's figures, tables and app are in `helpers.views.simulator`.

Notation: the paper's short names stay in the code and in the CLI's JSON keys (`Model.d` is
the model width, `Model.s` the number of experts, `Model.P` the parameters, `Model.B` the
tokens per batch); printed text spells them out (width, experts, params, tokens per batch),
because the course uses d for the data-parallel degree and s for the sequence length.
"""
