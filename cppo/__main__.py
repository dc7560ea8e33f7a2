"""``python -m cppo``: the command line of :mod:`cppo.cli`."""

from .cli import main

raise SystemExit(main())
