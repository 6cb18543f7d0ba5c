"""What each setting accepts: declarative constraints (as scikit-learn's ``_parameter_constraints``)."""

from __future__ import annotations

import math
from collections.abc import Collection
from numbers import Integral, Real

from dpneuro._utils.errors import ConfigError

# -- what each field accepts ---------------------------------------------------------------------
# Declarative, as scikit-learn's ``_parameter_constraints``: every field carries one constraint, which
# validate() and from_dict() run first; validate() itself keeps only the rules that tie fields together.


class Constraint:
    """What one field accepts: ``check`` refuses anything else naming the field; ``describe`` says what it takes."""

    def accepts(self, value) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, name: str, value) -> None:
        if not self.accepts(value):
            raise ConfigError(f"config field {name!r}: {self.describe()}, got {value!r}")


class Interval(Constraint):
    """A number of ``kind`` (``Integral`` or ``Real``) between ``left`` and ``right`` (None: unbounded).

    Booleans are refused, an integer field refuses 3.5, and a real one refuses NaN and, unless ``inf``, the
    infinities.
    """

    def __init__(self, kind, left, right, *, closed: str = "left", inf: bool = False, why: str = ""):
        if kind not in (Integral, Real) or closed not in ("left", "right", "both", "neither"):
            raise ValueError(f"Interval({kind!r}, closed={closed!r})")
        self.kind, self.left, self.right, self.closed, self.inf, self.why = kind, left, right, closed, inf, why

    def accepts(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, self.kind):
            return False
        if self.kind is Real and (math.isnan(value) or (math.isinf(value) and not self.inf)):
            return False
        lo_ok = self.left is None or (value >= self.left if self.closed in ("left", "both") else value > self.left)
        hi_ok = self.right is None or (value <= self.right if self.closed in ("right", "both") else value < self.right)
        return lo_ok and hi_ok

    def describe(self) -> str:
        what = "an integer" if self.kind is Integral else ("a number" if self.inf else "a finite number")
        lo = None if self.left is None else ("[" if self.closed in ("left", "both") else "(") + f"{self.left:g}"
        hi = None if self.right is None else f"{self.right:g}" + ("]" if self.closed in ("right", "both") else ")")
        why = f" ({self.why})" if self.why else ""
        if lo and hi:
            return f"{what} in {lo}, {hi}{why}"
        if lo:
            return f"{what} {'>=' if lo[0] == '[' else '>'} {self.left:g}{why}"
        if hi:
            return f"{what} {'<=' if hi[-1] == ']' else '<'} {self.right:g}{why}"
        return what + why


class StrOptions(Constraint):
    """One of a set of strings; ``options`` may be a function returning them (a table another module owns)."""

    def __init__(self, options):
        self._options = options

    @property
    def options(self) -> tuple[str, ...]:
        return tuple(self._options() if callable(self._options) else self._options)

    def accepts(self, value) -> bool:
        return isinstance(value, str) and value in self.options

    def describe(self) -> str:
        return "one of " + ", ".join(repr(o) for o in self.options)


class Boolean(Constraint):
    """true or false (not 0/1, not a string)."""

    def accepts(self, value) -> bool:
        return isinstance(value, bool)

    def describe(self) -> str:
        return "true or false"


class Text(Constraint):
    """Text, optionally also passing ``rule`` (a function returning what is wrong, or None)."""

    def __init__(self, what: str = "text", rule=None):
        self.what, self.rule = what, rule

    def accepts(self, value) -> bool:
        return isinstance(value, str) and (self.rule is None or self.rule(value) is None)

    def describe(self) -> str:
        return self.what

    def check(self, name: str, value) -> None:
        super().check(name, value)
        if self.rule is not None and (problem := self.rule(value)):
            raise ConfigError(f"config field {name!r}: {problem}")


class TextList(Constraint):
    """Text, or a list of texts."""

    def accepts(self, value) -> bool:
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))

    def describe(self) -> str:
        return "text or a list of texts"


class Table(Constraint):
    """A TOML table (dict), with keys among ``keys`` when given; each value passes ``values`` when given."""

    def __init__(self, keys: Collection[str] | None = None, values: Constraint | None = None):
        self.keys, self.values = keys, values

    def accepts(self, value) -> bool:
        return isinstance(value, dict) and (self.keys is None or not set(value) - set(self.keys))

    def describe(self) -> str:
        return "a table" + (f" with keys among {list(self.keys)}" if self.keys is not None else "")

    def check(self, name: str, value) -> None:
        super().check(name, value)
        if self.values is not None:
            for k, v in value.items():
                self.values.check(f"{name}.{k}", v)


class Label(Constraint):
    """A BIDS entity's label: text or an integer."""

    def accepts(self, value) -> bool:
        return isinstance(value, str) or (isinstance(value, Integral) and not isinstance(value, bool))

    def describe(self) -> str:
        return "a label (text or integer)"


class OrNone(Constraint):
    """``None`` (TOML: the field left out), which means ``meaning``, or what ``inner`` accepts."""

    def __init__(self, inner: Constraint, meaning: str):
        self.inner, self.meaning = inner, meaning

    def accepts(self, value) -> bool:
        return value is None or self.inner.accepts(value)

    def describe(self) -> str:
        return f"{self.inner.describe()}, or left out ({self.meaning})"

    def check(self, name: str, value) -> None:
        if value is not None:
            super().check(name, value)
            self.inner.check(name, value)


class Excluding(Constraint):
    """What ``inner`` accepts except ``value``, for the reason ``why``."""

    def __init__(self, inner: Constraint, value, why: str):
        self.inner, self.value, self.why = inner, value, why

    def accepts(self, value) -> bool:
        return self.inner.accepts(value) and value != self.value

    def describe(self) -> str:
        return f"{self.inner.describe()} other than {self.value!r} ({self.why})"


