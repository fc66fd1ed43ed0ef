from control.cli import main

raise SystemExit(main())
