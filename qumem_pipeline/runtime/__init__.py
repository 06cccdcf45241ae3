"""Process-level helpers shared by stages: length-bucketed padding for model batches, named
fault points for crash tests, and the location of the shared datasets."""
