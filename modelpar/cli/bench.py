"""``modelpar-bench``: measure layouts beside torch pipelining and DTensor (``modelpar.perf.bench``)"""

from modelpar.perf.bench import main

if __name__ == "__main__":
    main()
