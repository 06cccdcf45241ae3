"""The thin Dagster layer over qumem_pipeline: assets, sensors, jobs, and the Definitions."""
