from fitbench.cli import main

raise SystemExit(main())
