"""The benchmark harness: modelpar-bench, its plain-PyTorch peers, memory meters, reports, and the dry run of
one rank of a real-size job on the meta device."""
