"""Privacy accounting through Opacus' accountants (an optional dependency: ``pip install
opacus``; leanprop does not write its own).

An accountant is any object with ``step(noise_multiplier=, sample_rate=)`` and
``get_epsilon(delta)``: Opacus' ``RDPAccountant``, ``PRVAccountant`` and ``GaussianAccountant``
are made here by name (``"rdp"``, ``"prv"``, ``"gdp"``).
"""

from __future__ import annotations

from typing import Any

from ..errors import LeanpropError, LeanpropValueError

MECHANISMS = ("rdp", "prv", "gdp")


def _opacus_accountants() -> Any:
    try:
        import opacus.accountants as accountants
        import opacus.accountants.utils as utils
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise LeanpropError(
            "privacy accounting uses Opacus' accountants, which are not installed: "
            "pip install opacus (or pass accountant=None and account yourself)."
        ) from e
    return accountants, utils


def _check(mechanism: str) -> None:
    if mechanism not in MECHANISMS:
        raise LeanpropValueError(
            f"unknown accountant {mechanism!r}; allowed: {', '.join(map(repr, MECHANISMS))}, "
            "or an object with step(noise_multiplier=, sample_rate=) and get_epsilon(delta)."
        )


def make_accountant(mechanism: str) -> Any:
    """A fresh accountant by name: ``"rdp"``, ``"prv"`` or ``"gdp"`` (Opacus')."""
    _check(mechanism)
    accountants, _ = _opacus_accountants()
    return accountants.create_accountant(mechanism)


def noise_multiplier_for(
    target_epsilon: float, target_delta: float, sample_rate: float, steps: int,
    accountant: str = "rdp", epsilon_tolerance: float = 0.01,
) -> float:  # fmt: skip
    """The noise multiplier that spends ``target_epsilon`` at ``target_delta`` in ``steps``
    steps of Poisson sampling at ``sample_rate`` (Opacus' search, to ``epsilon_tolerance``)."""
    _check(accountant)
    _, utils = _opacus_accountants()
    sigma = utils.get_noise_multiplier(
        target_epsilon=target_epsilon, target_delta=target_delta, sample_rate=sample_rate,
        steps=steps, accountant=accountant, epsilon_tolerance=epsilon_tolerance,
    )  # fmt: skip
    return float(sigma)
