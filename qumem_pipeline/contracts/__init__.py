"""Shared contracts every stage agrees on: table schemas, id rules, version strings, output checks.

Enters: nothing (pure definitions). Leaves: schemas (`schema`), user-id validation (`ids`), the
versions stamped on every row (`versions`, `stage_versions`) and the blocking checks (`checks`).
"""
