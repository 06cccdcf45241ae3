import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from qumem_pipeline.eval.segmentation.evaluate import main  # noqa: E402

raise SystemExit(main())
