from .train import main

raise SystemExit(main())
