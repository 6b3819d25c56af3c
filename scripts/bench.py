"""Benchmark a GPT part tree (fused, fused run, unfused, backprop twin); see `fusedpc.bench`.

    python scripts/bench.py --compare
    python scripts/bench.py --n-blocks 1,2,4,8,16
"""

import sys

from fusedpc.bench import main

if __name__ == "__main__":
    sys.exit(main())
