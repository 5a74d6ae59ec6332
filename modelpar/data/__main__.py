from modelpar.data.cli import main

raise SystemExit(main())
