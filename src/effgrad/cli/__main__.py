"""``python -m effgrad.cli``: the ``effgrad`` command."""

from effgrad.cli.main import main

raise SystemExit(main())
