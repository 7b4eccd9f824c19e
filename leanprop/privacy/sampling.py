"""Poisson sampling of batches, as DP-SGD's accounting assumes: each step takes every example
independently with probability ``sample_rate`` (so batch sizes vary, and may be 0)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from ..errors import LeanpropValueError, checked_number


class PoissonBatchSampler(Sampler[list[int]]):
    """Batches of indices of ``range(num_samples)``, each index in each batch independently
    with probability ``sample_rate``; ``steps`` batches per epoch (default ``1 / sample_rate``).

    Data parallel over ``world_size`` ranks, rank ``rank`` samples the indices ``rank,
    rank + world_size, ...`` alone: the ranks' batches together are one Poisson-sampled batch
    of the whole dataset (Opacus' distributed sampler does the same with another partition).

    Args:
        num_samples: the dataset's size.
        sample_rate: the probability of each example in each batch, in ``(0, 1]``.
        steps: batches per epoch.
        generator: the random generator (None: torch's default one).
        rank: this rank, in ``range(world_size)``.
        world_size: the number of ranks sampling the dataset together.
    """

    def __init__(
        self, num_samples: int, sample_rate: float, steps: int | None = None,
        generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
    ) -> None:  # fmt: skip
        owner = "PoissonBatchSampler"
        checked_number(owner, "num_samples", num_samples, integer=True)
        checked_number(owner, "sample_rate", sample_rate, at_most=1.0)
        if steps is not None:
            checked_number(owner, "steps", steps, integer=True)
        checked_number(owner, "world_size", world_size, integer=True)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise LeanpropValueError(
                f"PoissonBatchSampler(rank={rank!r}, world_size={world_size}): the rank must "
                "be an int in range(world_size)."
            )
        self.num_samples, self.sample_rate = num_samples, float(sample_rate)
        self.generator = generator
        self.steps = steps if steps is not None else max(1, round(1 / self.sample_rate))
        self.shard = torch.arange(rank, num_samples, world_size)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(len(self.shard), generator=self.generator) < self.sample_rate
            yield self.shard[mask].tolist()


def _empty(one: Any, two: Any) -> Any:
    """The batch of 0 examples, from the collated batches of one example (``one``) and of
    that example twice (``two``): what grows from one to two is per example and is emptied
    (a tensor's first dimension, a list's entries); the rest is the structure and is kept
    (mappings, named tuples, lists and tuples of fields). Raises where it cannot tell (a
    custom batch type): a one-example batch passed off as empty would train on an example
    that was not sampled."""
    if isinstance(one, torch.Tensor) and isinstance(two, torch.Tensor):
        if one.dim() and two.dim() and (one.shape[0], two.shape[0]) == (1, 2):
            return one[:0]
        if one.shape == two.shape and torch.equal(one, two):
            return one  # (not per example: the same for any batch)
    elif isinstance(one, Mapping) and isinstance(two, Mapping) and one.keys() == two.keys():
        emptied = {k: _empty(one[k], two[k]) for k in one}
        try:
            return type(one)(emptied)
        except TypeError:
            return emptied
    elif isinstance(one, list | tuple) and type(one) is type(two):
        if (len(one), len(two)) == (1, 2):
            return type(one)()  # one entry per example: none
        if len(one) == len(two):
            fields = [_empty(a, b) for a, b in zip(one, two, strict=True)]
            return type(one)(*fields) if hasattr(one, "_fields") else type(one)(fields)
    elif type(one) is type(two) and one == two:
        return one
    raise LeanpropValueError(
        f"poisson_loader() cannot make an empty batch (0 samples) of a batch of type "
        f"{type(one).__name__}; pass a collate_fn that handles an empty list of examples."
    )


class _Collate:
    """``collate_fn`` that also collates an empty batch (from the batches of one example)."""

    def __init__(self, dataset: Dataset, collate_fn: Any) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate_fn(samples)
        example = self.dataset[0]
        return _empty(self.collate_fn([example]), self.collate_fn([example, example]))


def poisson_loader(
    dataset: Dataset, sample_rate: float, *, steps: int | None = None,
    generator: torch.Generator | None = None, rank: int = 0, world_size: int = 1,
    **loader_kwargs: Any,
) -> DataLoader:  # fmt: skip
    """A ``DataLoader`` over ``dataset`` whose batches are Poisson-sampled
    (:class:`PoissonBatchSampler`); an empty batch comes as tensors with 0 samples.

    Args:
        dataset: a map-style dataset.
        sample_rate: the probability of each example in each batch (expected batch size /
            ``len(dataset)``).
        steps: batches per epoch (default ``1 / sample_rate``).
        generator: the random generator for the sampling.
        rank, world_size: data parallel: this rank samples its share of the dataset
            (:class:`PoissonBatchSampler`).
        **loader_kwargs: other ``DataLoader`` options (``num_workers``, ``collate_fn``...);
            not ``batch_size``, ``shuffle``, ``sampler`` or ``batch_sampler``.
    """
    taken = {"batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"}
    taken &= loader_kwargs.keys()
    if taken:
        raise LeanpropValueError(
            f"poisson_loader() got {sorted(taken)}; the batches are Poisson-sampled at "
            "sample_rate, so those options have no meaning here."
        )
    collate = _Collate(dataset, loader_kwargs.pop("collate_fn", default_collate))
    sampler = PoissonBatchSampler(len(dataset), sample_rate, steps, generator, rank, world_size)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, **loader_kwargs)
