"""Optimizer steps fused into backward."""

from .in_backward import InBackward

__all__ = ["InBackward"]
