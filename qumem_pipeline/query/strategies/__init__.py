"""Query strategies behind one interface; see `base.QueryStrategy` and `registry`."""
