"""A working-set term written once: bytes as a sum of products of named factors.

A plan's table shows each buffer's formula with the run's numbers beside it ("1.05 x one layer's
linear weights x itemsize = 1.05 x 218103808 x 2"). Both the bytes and that text come from the
same `Factor`s, so the printed formula cannot drift from the arithmetic.
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Factor(NamedTuple):
    """One factor of a product: how the formula names it, and its value."""

    symbol: str
    value: int | float


def number(value: int | float) -> Factor:
    """A factor that is its own name: a constant (4 bytes of float32) or a calibrated count."""
    return Factor(f"{value:g}" if isinstance(value, float) else str(value), value)


def _product(factors: tuple[Factor, ...]) -> int | float:
    """The product, its whole factors multiplied exactly first (a count times an exact size)."""
    whole = math.prod(f.value for f in factors if isinstance(f.value, int))
    counts = [f.value for f in factors if not isinstance(f.value, int)]
    return whole if not counts else math.prod(counts) * whole


class Term(NamedTuple):
    """Bytes as a sum of products of factors (an empty sum is 0 bytes)."""

    products: tuple[tuple[Factor, ...], ...] = ()

    @classmethod
    def of(cls, *factors: Factor) -> Term:
        """One product."""
        return cls((tuple(factors),))

    @property
    def bytes(self) -> int:
        return round(sum(_product(p) for p in self.products))

    @classmethod
    def sum(cls, *terms: Term) -> Term:
        """The terms added, each product kept (and printed) apart."""
        return cls(tuple(p for term in terms for p in term.products))

    def times(self, count: float) -> Term:
        """Every product multiplied by a calibrated `count` of such buffers."""
        return Term(tuple((number(count), *p) for p in self.products))

    def when(self, condition: bool) -> Term:
        """This term where `condition` holds, else none (0 bytes)."""
        return self if condition else Term()

    @property
    def symbols(self) -> str:
        """The formula in names: "B x S x itemsize x D + ..."."""
        return " + ".join(" x ".join(f.symbol for f in p) for p in self.products) or "0"

    @property
    def formula(self) -> str:
        """The formula in names, then in this run's numbers."""
        values = " + ".join(" x ".join(number(f.value).symbol for f in p) for p in self.products)
        return f"{self.symbols} = {values or 0}"
