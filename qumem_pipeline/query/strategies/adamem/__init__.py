"""AdaMem (second seed) on the same tables: participant resolution, memory graph, lexical index,
route-planned hybrid retrieval and the ``adamem`` query strategy. No Dagster imports here."""
