"""The training-cost simulator of notebook 06: Erdil & Schneider-Joseph's model (2024).

Modules follow the spec (../shared/specs/cost_model.md): `matmul` (§2), `scaling` (§3),
`comm` (§4), `reference` (§5–§6 transcribed directly), `search` (the same search, fast),
`curve` (§7), `config`/`settings` (records, JSON, validation), `report` (JSON output) and
`__main__` (the CLI).
"""
