"""The layout benchmark as a script: ``modelpar-bench`` with the same arguments (Hydra overrides).

    python benchmarks/layouts.py                                   # recipes/bench.yaml's sweep, a few minutes
    python benchmarks/layouts.py 'bench.sweep=[single,tp2,pp2-1f1b,tp2-pp2-1f1b]' bench.rounds=6

See ``modelpar.bench.harness`` for what is measured; results land in ``benchmarks/results/bench.*``.
"""

from modelpar.cli.bench import main

if __name__ == "__main__":
    main()
