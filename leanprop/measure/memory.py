"""Peak memory of a block of code: exact tensor bytes, on CPU and CUDA.

``with leanprop.track_memory() as mem: ...`` then ``mem.peak_bytes``: the largest number of
bytes held at once by tensor storages created inside the block.

* CUDA: the caching allocator's own statistics (``max_memory_allocated`` after
  ``reset_peak_memory_stats``, minus the bytes allocated at entry).
* CPU: a ``TorchDispatchMode`` sees every ATen op; each output whose storage is new (not a view,
  not an in-place result, not one of the tensors registered as pre-existing) is added to a
  live set with a weak reference; storages whose last tensor died are removed before each op.
  This counts exactly the tensor bytes (no allocator slack), deterministically.
  Not counted: scratch memory an op allocates and frees internally (e.g. a convolution's
  workspace), and tensors created without going through the dispatcher (``torch.from_numpy``).
  The scratch buffers :func:`leanprop.per_sample` keeps on CPU between backward passes (at
  most 64 MiB) are released at entry: a backward inside the block makes them anew, and its
  peak counts them (else a step after the first would hide the memory it holds).

Why not RSS (what ``memory_profiler`` and ``/proc/self/status`` report)? The resident set
includes memory the allocator keeps after tensors are freed (glibc arenas and heap
fragmentation), counts pages only once touched (a fresh ``torch.empty`` costs nothing until
written), is shared with everything else in the process (the interpreter, imported libraries,
other threads), and sampling tools miss short peaks between samples. The same code can report
tens of MiB more or less from one run to the next.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from .._torch_compat import TorchDispatchMode, tree_leaves
from ..errors import LeanpropValueError
from ..per_sample.chunks import release_kept


def _storage_key(t: Tensor) -> tuple[str, int]:
    """The storage object itself (stable when ``resize_`` or ``out=`` moves its data)."""
    return (str(t.device), t.untyped_storage()._cdata)


def _aliases(func: Any) -> bool:
    """Whether the op's outputs alias its inputs (views, in-place and out= variants)."""
    schema = getattr(func, "_schema", None)
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


class _LiveStorages(TorchDispatchMode):
    """Tracks the bytes of storages created while active, and their peak."""

    def __init__(self, existing: Iterable[Tensor]) -> None:
        super().__init__()
        self.live: dict[tuple[str, int], tuple[StorageWeakRef, int]] = {}
        self.known: dict[tuple[str, int], StorageWeakRef] = {}
        for t in existing:
            self.known[_storage_key(t)] = StorageWeakRef(t.untyped_storage())
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key, (ref, nbytes) in list(self.live.items()):
            if ref.expired():
                del self.live[key]
                self.current -= nbytes

    def _is_new(self, key: tuple[str, int]) -> bool:
        if key in self.live:
            return False
        ref = self.known.get(key)
        if ref is None:
            return True
        if ref.expired():  # address reused after a pre-existing tensor died
            del self.known[key]
            return True
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        aliases = _aliases(func)  # views, in-place and out= ops: may grow a storage
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type != "cpu":
                continue
            storage, key = t.untyped_storage(), _storage_key(t)
            if key in self.live:
                ref, before = self.live[key]
                if storage.nbytes() != before:  # resize_, or out= into a smaller tensor
                    self.live[key] = (ref, storage.nbytes())
                    self.current += storage.nbytes() - before
            elif not aliases and self._is_new(key):  # also empty: it may grow (out=)
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _tensors_of(objs: Iterable[Any]) -> list[Tensor]:
    out: list[Tensor] = []
    for o in objs:
        if isinstance(o, nn.Module):
            out += list(o.parameters()) + list(o.buffers())
            out += [p.grad for p in o.parameters() if p.grad is not None]
        elif isinstance(o, Tensor):
            out.append(o)
        else:
            out += [t for t in tree_leaves(o) if isinstance(t, Tensor)]
    return out


class track_memory:
    """Context manager measuring the peak tensor memory of its block.

    Example:
        >>> import torch, leanprop
        >>> with leanprop.track_memory() as mem:
        ...     a = torch.empty(1000)  # 4000 bytes
        ...     b = torch.empty(500)  # 2000 bytes
        ...     del a
        ...     c = torch.empty(250)
        >>> mem.peak_bytes
        6000

    Args:
        device: ``"cpu"`` (dispatch-mode tracker) or a CUDA device (allocator statistics).
        existing: modules and tensors alive before the block (parameters, inputs); their
            storages are never counted, also when an op returns them (CPU).

    Attributes:
        peak_bytes: peak bytes above the state at entry, set when the block exits.
    """

    def __init__(self, device: str | torch.device = "cpu", existing: Iterable[Any] = ()) -> None:
        if not isinstance(device, str | torch.device):
            raise LeanpropValueError(
                f"track_memory() got device={device!r}; pass 'cpu' or a CUDA device such as "
                "'cuda' or 'cuda:0' (a string or torch.device)."
            )
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise LeanpropValueError(
                f"track_memory() got device {str(self.device)!r}; allowed: 'cpu' or a CUDA "
                "device such as 'cuda' or 'cuda:0'."
            )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise LeanpropValueError(
                "track_memory(device='cuda') asked for, but torch sees no CUDA device; use 'cpu'."
            )
        self._existing = list(existing)
        self._mode: _LiveStorages | None = None
        self._base = 0
        self.peak_bytes = 0

    @property
    def peak_mib(self) -> float:
        """``peak_bytes`` in MiB."""
        return self.peak_bytes / 2**20

    @property
    def current_bytes(self) -> int:
        """Bytes allocated inside the block and alive now (read inside the block; e.g. what
        a forward leaves saved for its backward)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device) - self._base
        if self._mode is None:
            raise LeanpropValueError("track_memory.current_bytes is read inside the block.")
        self._mode._sweep()
        return self._mode.current

    def __enter__(self) -> track_memory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            release_kept()  # (see the module's docstring)
            self._mode = _LiveStorages(_tensors_of(self._existing))
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        assert self._mode is not None
        try:
            self._mode.__exit__(None, None, None)
        finally:
            self.peak_bytes = self._mode.peak
            self._mode = None
