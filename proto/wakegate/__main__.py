"""`python -m wakegate …` is the `wakegate` console script (wakegate.cli)."""

from wakegate.cli import main

raise SystemExit(main())
