"""Without CUDA the kernels run in Triton's interpreter, which must be chosen before triton is first imported.

A CPU-only torch build turns it on in ``modelpar_kernels.grid``; this covers a CUDA build on a machine without
a GPU. Being set at collection, it is also inherited by the emulated-rank workers started later.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
