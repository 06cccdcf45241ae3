"""Process-level helpers shared by stages: length-bucketed padding for model batches, named
fault points for crash tests, the location of the shared datasets, and child servers on loopback
(free port, process-group stop)."""
