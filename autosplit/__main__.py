import sys

from autosplit.cli import main

sys.exit(main())
