"""Where Triton has no wheels (macOS, Windows) the package still imports and the torch path runs."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["triton"] = None  # what `import triton` meets on a platform without its wheels
import torch
import modelpar_kernels as K
from modelpar.model.config import ModelConfig
from modelpar.model.transformer import build_model
model = build_model(ModelConfig(vocab_size=50, hidden=32, heads=4, kv_heads=2, ffn_hidden=40), seed=0)
print(tuple(model(torch.randint(0, 50, (2, 8))).shape))
try:
    K.rms_norm(torch.randn(3, 8), torch.ones(8), 1e-5, backend="triton")
except RuntimeError as exc:
    print(exc)
"""


def test_torch_backend_runs_and_triton_backend_names_the_missing_package():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shape, error = out.stdout.strip().splitlines()
    assert shape == "(2, 8, 50)"
    assert "needs the triton package" in error
