"""The layout benchmark as a script: ``modelpar-bench`` with the same arguments (Hydra overrides).

    python benchmarks/layouts.py                                   # recipes/bench.yaml's sweep, a few minutes
    python benchmarks/layouts.py 'bench.sweep=[single,tp2,pp2-1f1b,tp2-pp2-1f1b]' bench.rounds=6

See ``modelpar.bench.harness`` for what is measured. This script updates the committed results
(``benchmarks/results/bench.*``) unless given another ``bench.results_dir=``; ``modelpar-bench`` writes into its
run's directory.
"""

import sys

from modelpar.cli.bench import main

if __name__ == "__main__":
    if not any(a.lstrip("+").startswith("bench.results_dir=") for a in sys.argv[1:]):
        sys.argv.append("bench.results_dir=benchmarks/results")
    main()
