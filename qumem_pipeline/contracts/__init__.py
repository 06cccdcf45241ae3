"""Shared contracts every stage agrees on: table schemas, id rules, version strings, output checks.

Enters: nothing (pure definitions). Leaves: schemas (`schema`), user-id validation (`ids`), the
versions stamped on every row (`versions`; `stage_versions` hashes what each stage declares in its own
`version` module, importing no stage) and the blocking checks (`checks`).
"""
