"""`python -m fusedpc.bench`."""

import sys

from fusedpc.bench import main

sys.exit(main())
