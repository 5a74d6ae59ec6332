"""RoPE scaling: the rotary frequencies of a model trained at one length and stretched to a longer one.

``model.rope_scaling`` (a ``RopeScaling``) says how the inverse frequencies ``theta^(-2i/d)``, i < d/2, of the
plain rotary embedding are changed (d: the rotated head width, ``qk_rope_head_dim`` under latent attention):

- ``linear`` (position interpolation): every frequency divided by ``factor``.
- ``llama3`` (Llama 3.1+): with wavelengths ``2*pi/f`` and ``L = original_max_position_embeddings``, a frequency
  whose wavelength is below ``L / high_freq_factor`` is kept, one above ``L / low_freq_factor`` is divided by
  ``factor``, and one between is blended: ``(1 - a) f / factor + a f`` with ``a = (L / wavelength -
  low_freq_factor) / (high_freq_factor - low_freq_factor)``.
- ``yarn`` (Peng et al. 2023): the dimensions rotating more than ``beta_fast`` times over ``L`` keep their
  frequency, those rotating fewer than ``beta_slow`` times are divided by ``factor``, with a linear ramp between
  (the bounds rounded outwards unless ``truncate`` is false). cos and sin are multiplied by ``attention_factor``
  (0: derived, ``m(factor, mscale) / m(factor, mscale_all_dim)`` when both are given, else ``m(factor, 1)``,
  where ``m(s, k) = 0.1 k ln(s) + 1`` for s > 1, else 1). Latent attention (DeepSeek-V2/V3) also multiplies its
  softmax scale by ``m(factor, mscale_all_dim)^2`` when ``mscale_all_dim`` is given (``softmax_factor``).

``dynamic`` NTK scaling is refused: it changes the frequencies with the length of the sequence seen at
inference, so one set of weights would compute a different function at each evaluation length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
DYNAMIC_REFUSED = (
    "dynamic is not supported: dynamic NTK rescales the frequencies by the sequence length seen at inference, so "
    "the model would compute a different function at every length; use linear, llama3 or yarn"
)


class RopeScalingError(ValueError):
    """A RoPE scaling that cannot be computed; the message is one line naming the field and a fix."""


@dataclass
class RopeScaling:
    """How RoPE's frequencies are scaled (see the module docstring); ``type=default``: they are not."""

    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int = 0  # llama3, yarn: the length the model was trained at
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 0.0  # yarn: 0 not given
    mscale_all_dim: float = 0.0  # yarn: 0 not given
    attention_factor: float = 0.0  # yarn: cos/sin multiplied by it; 0: derived from factor and the mscales
    truncate: bool = True  # yarn: the ramp's bounds rounded outwards

    @property
    def enabled(self) -> bool:
        return self.type != "default"

    def fields(self) -> tuple[str, ...]:
        """The fields this type reads (what it is, beside its type)."""
        return {
            "default": (),
            "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": (
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
                "attention_factor",
                "truncate",
            ),  # fmt: skip
        }[self.type]

    def identity(self) -> dict:
        """The type and the fields it reads: two scalings that agree on them compute the same frequencies."""
        return {"type": self.type} | {name: getattr(self, name) for name in self.fields()}

    def check(self) -> None:
        if self.type == "dynamic":
            raise RopeScalingError(f"model.rope_scaling.type={DYNAMIC_REFUSED}")
        if self.type not in ROPE_TYPES:
            raise RopeScalingError(f"model.rope_scaling.type={self.type!r} is not one of {ROPE_TYPES}")
        if not self.enabled:
            return
        if not self.factor >= 1:
            raise RopeScalingError(f"model.rope_scaling.factor={self.factor} must be >= 1 (how much longer)")
        if self.type in ("llama3", "yarn") and self.original_max_position_embeddings < 1:
            raise RopeScalingError(
                f"model.rope_scaling.original_max_position_embeddings={self.original_max_position_embeddings} must "
                f"be >= 1 for {self.type}: the length the model was trained at"
            )
        if self.type == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise RopeScalingError(
                f"model.rope_scaling.low_freq_factor={self.low_freq_factor} must be > 0 and below "
                f"high_freq_factor={self.high_freq_factor}"
            )
        if self.type == "yarn":
            for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, name) < 0:
                    raise RopeScalingError(f"model.rope_scaling.{name}={getattr(self, name)} must be >= 0")

    def key(self) -> tuple:
        """Hashable: what the tables depend on."""
        return tuple(self.identity().items())


def yarn_mscale(scale: float, k: float = 1.0) -> float:
    """YaRN's attention temperature term ``0.1 k ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0


def inverse_frequencies(dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The rotary inverse frequencies [dim / 2] (fp32) of a head of ``dim`` rotated dims, scaled by ``scaling``.
    Computed in fp64 and rounded once."""
    plain = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    s = scaling or RopeScaling()
    if s.type == "linear":
        plain = plain / s.factor
    elif s.type == "llama3":
        plain = _llama3(plain, s)
    elif s.type == "yarn":
        plain = _yarn(plain, dim, theta, s)
    return plain.float()


def _llama3(freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    length = s.original_max_position_embeddings
    wavelength = 2 * math.pi / freq
    blend = ((length / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0, 1)
    # blend 1: kept (short wavelengths), 0: divided by factor (long ones), between: mixed
    return (1 - blend) * freq / s.factor + blend * freq


def _yarn(freq: torch.Tensor, dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    def dim_of(rotations: float) -> float:  # the dimension rotating ``rotations`` times over the trained length
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast or 32.0), dim_of(s.beta_slow or 1.0)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    # ramp 0: fast dims, extrapolated (kept); 1: slow dims, interpolated (divided by factor)
    return ramp * freq / s.factor + (1 - ramp) * freq


def cos_sin_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by (YaRN's attention factor; 1 for the other types)."""
    if scaling is None or scaling.type != "yarn":
        return 1.0
    if scaling.attention_factor:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def softmax_factor(scaling: RopeScaling | None) -> float:
    """What latent attention multiplies its softmax scale 1/sqrt(qk head dim) by: ``m(factor, mscale_all_dim)^2``
    under YaRN with ``mscale_all_dim`` (DeepSeek-V2/V3), else 1."""
    if scaling is None or scaling.type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def table_options(dim: int, theta: float, scaling: RopeScaling | None) -> dict:
    """The keyword arguments of ``modelpar_kernels.rope_tables`` that scale its tables (none when unscaled, so
    an unscaled model's tables are the plain ones bit for bit)."""
    if scaling is None or not scaling.enabled:
        return {}
    return {"inv_freq": inverse_frequencies(dim, theta, scaling), "scale": cos_sin_factor(scaling)}


__all__ = [
    "DYNAMIC_REFUSED",
    "ROPE_TYPES",
    "RopeScaling",
    "RopeScalingError",
    "cos_sin_factor",
    "inverse_frequencies",
    "softmax_factor",
    "table_options",
    "yarn_mscale",
]
