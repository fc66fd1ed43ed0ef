"""`python -m wakegate …` is the `wakegate` console script."""

from wakegate.control.cli import main

raise SystemExit(main())
