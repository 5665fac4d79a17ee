"""An immutable set of named switches, the shape shared by defects and fixes."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

S = TypeVar("S", bound="SwitchSet")


@dataclass(frozen=True, slots=True)
class SwitchSet:
    """Switched-on names out of ``KNOWN`` (a subclass's catalogue); unknown names are rejected
    with the list of known ones. Sets of different kinds never compare equal."""

    names: frozenset[str] = frozenset()
    KIND: ClassVar[str] = "switch"
    KNOWN: ClassVar[Mapping[str, Any]] = {}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.names) - set(self.KNOWN))
        if unknown:
            raise ValueError(f"unknown {self.KIND} {unknown[0]!r}; known: "
                             f"{', '.join(self.KNOWN)}")

    @classmethod
    def of(cls: type[S], names: Iterable[str] = ()) -> S:
        return cls(frozenset(names))

    def on(self, name: str) -> bool:
        assert name in self.KNOWN, name
        return name in self.names

    def sorted(self) -> list[str]:
        return sorted(self.names)
