"""Derived programs: the vector-Jacobian program of a typed IR program (docs/autodiff.md)."""

from coconetc.autodiff.vjp import default_wrt, vjp

__all__ = ["default_wrt", "vjp"]
