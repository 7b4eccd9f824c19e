"""Private or version-dependent torch APIs, in one place."""

from __future__ import annotations

from collections.abc import Callable

import torch


def current_graph_task_id() -> int:
    """Id of the backward pass running on this thread, -1 outside backward."""
    return torch._C._current_graph_task_id()


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass ends (only inside backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
