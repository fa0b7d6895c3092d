"""The training-cost simulator of notebook 06: Erdil & Schneider-Joseph's model (2024).

Modules follow the spec (shared/specs/cost_model.md), one idea each:
`settings` and `config` (what a configuration is, as JSON, validated), `matmul` (§2),
`scaling` (§3), `comm` (§4), `reference` (§5–§6 transcribed directly), `placement` and
`search` (the same search, fast and bit-identical), `curve` (§7), `report` (the JSON
output), `__main__` (the CLI) and `widgets` (the notebook's figures, tables and app).
"""
