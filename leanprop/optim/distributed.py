"""InBackward under ``DistributedDataParallel``: step each bucket once all-reduced, free it.

DDP reduces gradients in buckets: a bucket is a flat buffer holding the gradients of a few
parameters; when all of them are final, DDP hands it to its *communication hook* (public API:
``DistributedDataParallel.register_comm_hook``). The hook installed here averages the bucket
across ranks exactly as DDP does by default (multiply by ``1 / world_size``, all-reduce sum),
then, when that all-reduce has finished, steps the bucket's parameters with the averaged
gradients by one call of the inner optimizer, while the rest of backward goes on.

Memory: DDP keeps a bucket buffer per bucket for the model's whole life, together as large as
all the gradients (torch's own optimizer-in-backward keeps them too). Here each bucket's storage
is released (resized to 0 bytes) as soon as its parameters are stepped, and regrown just before
DDP copies the next gradient into it. So between backward passes, and when backward starts
(when activations are at their peak), the buckets hold no memory, and during backward only the
buckets being filled or reduced do. DDP's own end-of-backward bookkeeping re-views every
bucket, so all are regrown for that moment (never written; activations are gone by then) and
released right after. ``opt.ddp_bucket_bytes`` reads the bucket bytes held now,
``opt.ddp_bucket_peak_bytes`` the most held at once in the last backward (both read from the
storages themselves). Once, in the second iteration, DDP replaces its buckets by ones ordered
as the gradients arrived; the old ones are dropped as the new ones are first seen. On CUDA the
caching allocator makes the release and regrowth cheap; on
CPU each regrowth is a fresh allocation.

Requirements, checked at construction: ``gradient_as_bucket_view=True`` (else DDP would copy
every bucket back into a separate ``.grad`` at the end), ``find_unused_parameters=False`` and
``static_graph=False`` (DDP writes zeros into an unused parameter's slot, which must exist),
and the optimizer owns exactly the DDP module's trainable parameters.

Exactness: the gradients stepped are the values DDP would leave in ``.grad``, so parameters are
bit-identical to ``backward(); step()`` with ordinary DDP (tested with gloo, 2 processes).
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._torch_compat import ddp_syncs_gradients, queue_callback, torch_version
from ..errors import LeanpropValueError

if TYPE_CHECKING:
    from .in_backward import InBackward


class DDPStepper:
    """Communication hook and bucket-memory bookkeeping for one DDP module."""

    def __init__(self, opt: InBackward, ddp: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise LeanpropValueError(
                f"InBackward(ddp=...) needs a torch.nn.parallel.DistributedDataParallel module, "
                f"got {type(ddp).__name__}."
            )
        settings = {
            "gradient_as_bucket_view=True": ddp.gradient_as_bucket_view,
            "find_unused_parameters=False": not ddp.find_unused_parameters,
            "static_graph=False": not ddp.static_graph,
        }
        wrong = [name for name, ok in settings.items() if not ok]
        if wrong:
            raise LeanpropValueError(
                "InBackward(ddp=...) needs DistributedDataParallel(..., "
                f"{', '.join(wrong)}); got the opposite. Bucket memory is released between "
                "backward passes, which needs gradients to live in DDP's buckets and every "
                "bucket slot to be written by a gradient."
            )
        ours = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}
        theirs = {id(p) for p in ddp.parameters() if p.requires_grad}
        if ours != theirs:
            raise LeanpropValueError(
                f"InBackward(ddp=...): the optimizer steps {len(ours)} trainable tensors, the DDP "
                f"module has {len(theirs)}, and they are not the same set. Build it from the "
                "DDP module's parameters: InBackward(ddp.parameters(), ..., ddp=ddp)."
            )
        # weak: the all-reduce callbacks hold this object and may drop it on a communication
        # thread; were it the last owner of the process group, the group would be destroyed
        # there, joining its own thread (the process aborts)
        self.opt, self._ddp = opt, weakref.ref(ddp)
        self.world = dist.get_world_size(ddp.process_group)
        self.active = True
        self._lock = threading.Lock()  # all-reduce callbacks may finish on other threads
        self._storage: dict[int, tuple[torch.UntypedStorage, int]] = {}  # id(p) -> bucket
        self._pending: list[torch.futures.Future] = []  # this backward's bucket steps
        self._peak = 0
        self.peak_bytes = 0  # most bucket bytes held at once in the last backward
        self._handles = [
            p.register_post_accumulate_grad_hook(self._regrow)
            for p in ddp.parameters()
            if p.requires_grad
        ]
        ddp.register_comm_hook(self, DDPStepper._comm_hook)

    # ------------------------------------------------------------------ bucket memory
    def held_bytes(self) -> int:
        """Bytes held now by the bucket storages this stepper manages."""
        distinct = {s.data_ptr(): s.nbytes() for s, _ in self._storage.values()}
        return sum(distinct.values())

    def _regrow(self, p: Tensor) -> None:
        """Before DDP copies ``p``'s gradient into its bucket: give the bucket its memory."""
        entry = self._storage.get(id(p))
        ddp = self._ddp()
        syncing = ddp is not None and ddp_syncs_gradients(ddp)  # not inside no_sync()
        if entry is not None and entry[0].nbytes() == 0 and syncing:
            entry[0].resize_(entry[1])
            self._peak = max(self._peak, self.held_bytes())

    def restore(self) -> None:
        """Give every bucket its memory back and stop stepping (DDP then works as usual)."""
        self.active = False
        for storage, nbytes in self._storage.values():
            if storage.nbytes() == 0:
                storage.resize_(nbytes)
                storage.fill_(0)
        self._storage.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ communication hook
    # no annotations: DDP refuses a hook whose bucket is annotated other than dist.GradBucket
    def _comm_hook(self, bucket):
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self.world)  # DDP's default averaging, bit for bit
        group = self._ddp().process_group  # DDP calls this hook, so it is alive
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        if not self.active:
            return fut.then(lambda f: f.value()[0])
        current = buffer.untyped_storage()
        with self._lock:
            for p in bucket.parameters():  # DDP may have rebuilt its buckets: drop stale ones
                old = self._storage.pop(id(p), None)
                if old is not None and old[0].nbytes() and old[0].data_ptr() != current.data_ptr():
                    old[0].resize_(0)
            self._peak = max(self._peak, self.held_bytes() + current.nbytes())
        if not self._pending:  # first bucket of this backward
            self.opt.begin_backward()
            queue_callback(self._before_finalize)
        stepped = fut.then(lambda f: self._step_bucket(bucket, f.value()[0]))
        self._pending.append(stepped)
        return stepped

    def _step_bucket(self, bucket: Any, reduced: Tensor) -> Tensor:
        """When the bucket's all-reduce is done: step its parameters, free its memory."""
        params = bucket.parameters()
        with self._lock:
            for p, g in zip(params, bucket.gradients(), strict=True):
                p.grad = g
            self.opt.step_bucket(params)
            storage = reduced.untyped_storage()
            for p in params:
                self._storage[id(p)] = (storage, storage.nbytes())
            storage.resize_(0)
        return reduced

    def _before_finalize(self) -> None:
        """DDP's end of backward re-reads every bucket: give them memory for that moment."""
        torch.futures.wait_all(self._pending)
        self._pending = []
        for storage, nbytes in self._storage.values():
            if storage.nbytes() == 0:
                storage.resize_(nbytes)  # never written: DDP only re-views them
        self.peak_bytes, self._peak = max(self._peak, self.held_bytes()), 0
        queue_callback(self._after_finalize)

    def _after_finalize(self) -> None:
        """DDP pointed each ``.grad`` at its bucket again: drop them and free the buckets."""
        for g in self.opt.param_groups:
            for p in g["params"]:
                p.grad = None
        for storage, _ in self._storage.values():
            storage.resize_(0)
        self.opt.end_backward()


def fsdp_units(model: torch.nn.Module, params: list[Tensor]) -> dict[int, int]:
    """Map each of ``params`` to the FSDP2 unit that reduce-scatters it.

    A unit is a module on which ``fully_shard`` was called; it owns its parameters except
    those of nested units. FSDP2 reduce-scatters a unit's gradients together and then runs
    their post-accumulate-grad hooks one after the other, so a unit's parameters can be
    stepped by one optimizer call once the last of them is reduced.

    Returns:
        ``id(p) -> unit index`` for every parameter in ``params`` inside a unit.

    Raises:
        LeanpropValueError: ``model`` contains no ``fully_shard`` module.
    """
    if torch_version() < (2, 6):
        raise LeanpropValueError(
            f"InBackward(fsdp=...) needs torch >= 2.6 (FSDP2's public fully_shard API); this "
            f"is torch {torch.__version__}. Upgrade torch, or leave fsdp= out."
        )
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise LeanpropValueError(
            f"InBackward(fsdp=...) got a {type(model).__name__} with no fully_shard() module in "
            "it; pass the model after calling torch.distributed.fsdp.fully_shard on it."
        )
    wanted = {id(p) for p in params}
    owner: dict[int, int] = {}
    for index, unit in enumerate(units):  # modules() lists parents first: children overwrite
        for p in unit.parameters():
            if id(p) in wanted:
                owner[id(p)] = index
    return owner
