from rlkit.cli import main

raise SystemExit(main())
