from kvq.cli import main

raise SystemExit(main())
