"""Low-precision training: float8 linear layers and grouped experts through torchao (``float8``)."""

from .float8 import Float8Config, enable_fp8, fp8_config

__all__ = ["Float8Config", "enable_fp8", "fp8_config"]
