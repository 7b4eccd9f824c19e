"""BackPACK's module path ``core.derivatives.convnd``: its ``weight_jac_t_save_memory``
setting (leanprop bounds the convolutions' scratch memory itself: accepted, see
``leanprop.compat.backpack``)."""

from ... import weight_jac_t_save_memory

__all__ = ["weight_jac_t_save_memory"]
