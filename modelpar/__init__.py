"""modelpar: pipeline and tensor model-parallel training for large transformers."""

from modelpar.parallel.layout import LayoutError, ParallelLayout, RankCoords

__all__ = ["LayoutError", "ParallelLayout", "RankCoords"]
__version__ = "0.1.0"
