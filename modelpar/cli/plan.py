"""``modelpar-plan``: search layouts for a model on a cluster and print the best (``modelpar.perf.plan``)."""

from modelpar.perf.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
