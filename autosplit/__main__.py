"""``python -m autosplit``: the command line (:func:`autosplit.cli.main`), its exit status the process's."""

import sys

from autosplit.cli import main

__all__ = []

sys.exit(main())
