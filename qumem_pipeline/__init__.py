"""qumem-pipeline domain core: importable and testable without Dagster."""

__version__ = "0.1.0"
