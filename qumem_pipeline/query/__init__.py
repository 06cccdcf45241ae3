"""Stage 5 (QUMem §3.4, query-conditioned user state): queries in, user states out.

Enters: `queries` (input file), typed memory stores. Leaves: `query_states`. `retrieval` reads the
per-type stores under the query's as-of; `strategies/` holds every answer strategy behind one
interface (`strategies.base`) and its registry (`strategies.registry`).
"""
