"""Where tables live and how they are erased: the data layout (atomic table writes), the DuckDB
warehouse loaded from it, and full deletion of a user (`forget`)."""
