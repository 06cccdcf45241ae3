from qumem_pipeline.episodes.continuity.train import main

raise SystemExit(main())
