"""``python -m krex``: the command-line interface."""

from krex.cli.main import main

raise SystemExit(main())
