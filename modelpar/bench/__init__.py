"""The benchmark harness: modelpar-bench, its plain-PyTorch peers, memory meters and reports."""
