"""User ids become Dagster partition keys, directory names and SQL literals: validate them strictly."""

import re

USER_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class InvalidUserId(ValueError):
    """A user id that may not become a partition key, a path component or a SQL literal."""


def is_valid_user_id(value: object) -> bool:
    return (
        isinstance(value, str)
        and USER_ID_PATTERN.fullmatch(value) is not None
        and ".." not in value
    )


def valid_user_id_expr(col: str = "user_id"):
    """The same rule as is_valid_user_id, as a polars expression (null -> False), for whole columns."""
    import polars as pl

    c = pl.col(col)
    return (c.str.contains(USER_ID_PATTERN.pattern) & ~c.str.contains("..", literal=True)).fill_null(False)


def validate_user_id(value: object) -> str:
    """Return the id unchanged, or raise InvalidUserId naming what is wrong with it."""
    if not is_valid_user_id(value):
        raise InvalidUserId(
            f"invalid user id {value!r}: must match {USER_ID_PATTERN.pattern} "
            "(ASCII letters, digits, '_', '.', '-'; no '..'; at most 128 characters)"
        )
    return value  # type: ignore[return-value]
