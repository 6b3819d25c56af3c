"""Wall time of a study of N seeds (one vmapped program) against the same N runs one after
another, each in a fresh process, compile included.

`fusedpc study --seeds N` (no varied setting) against N times `fusedpc train --seed i` with
the same settings (no compilation cache, no sample, no TensorBoard): the runs a researcher
would otherwise start by hand. The two alternate `--rounds` times (study first, then the
runs). Prints one JSON line per measurement and a summary line with the ratio of the
medians.

    python scripts/seeds_speed.py                          # config S, 4 seeds, 1,000 steps
    python scripts/seeds_speed.py --seeds 2 --steps 20 --rounds 1 --smoke
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SMOKE = ["--width", "16", "--n-heads", "2", "--n-blocks", "1", "--ff-width", "32",
         "--max-len", "16", "--batch", "4"]


def _fusedpc(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fusedpc.cli", *args], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="a tiny model (the test's)")
    args = parser.parse_args(argv)
    common = ["--steps", str(args.steps), "--eval-every", str(args.steps)]
    common += SMOKE if args.smoke else []
    studies, sequences = [], []
    for round_ in range(args.rounds):
        scratch = tempfile.mkdtemp()
        try:
            study_s = _fusedpc(["study", "--seeds", str(args.seeds), "--out",
                                f"{scratch}/study", *common])
            sequence_s = sum(
                _fusedpc(["train", "--seed", str(seed), "--out", f"{scratch}/run{seed}",
                          "--sample-tokens", "0", "--compile-cache", "none", *common])
                for seed in range(args.seeds))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        studies.append(study_s)
        sequences.append(sequence_s)
        print(json.dumps({"round": round_, "study_s": round(study_s, 2),
                          "runs_one_after_another_s": round(sequence_s, 2)}), flush=True)
    summary = {"summary": "seeds", "seeds": args.seeds, "steps": args.steps,
               "study_s": round(statistics.median(studies), 2),
               "runs_one_after_another_s": round(statistics.median(sequences), 2)}
    summary["ratio"] = round(summary["study_s"] / summary["runs_one_after_another_s"], 3)
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
