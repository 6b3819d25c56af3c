"""`python -m fusedpc.cli`."""

import sys

from fusedpc.cli import main

sys.exit(main())
