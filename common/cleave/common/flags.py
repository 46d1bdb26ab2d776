"""Typed settings that are also command-line flags: one definition per flag.

A settings class is a frozen dataclass whose fields are declared with :func:`setting`. From
that one declaration come the argparse flags (:meth:`Settings.add_arguments`), the typed value
read back from a parsed namespace (:meth:`Settings.from_args`) and the command line that makes a
process parse the same value again (:meth:`Settings.to_args`). The operator's pod builders and
``cleave up`` both write process command lines with ``to_args``, and the processes read them
with ``from_args``, so a renamed flag or a changed type cannot drift between the two.

A field whose type is itself a settings class is a group: its flags join the parent's.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Self, TypeVar

T = TypeVar("T")
_KEY = "cleave.flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    help: str
    parse: Callable[[str], Any]
    show: Callable[[Any], str]
    choices: tuple[str, ...] | None
    metavar: str | None
    repeat: bool  # append: the flag may be given several times, the value is a tuple
    several: bool  # a repeated flag that also takes several values at once (nargs="+")


def setting(default: T, help: str, *, parse: Callable[[str], Any] = str,
            show: Callable[[Any], str] = str, choices: Sequence[str] | None = None,
            metavar: str | None = None, repeat: bool = False, several: bool = False) -> T:
    """A field that is also the flag ``--field-name``. A flag's value is text (argparse has no
    booleans that round-trip), and a repeated flag starts empty. ``several``: a repeated flag
    that also takes ``--flag A B`` (as vLLM's ``nargs="+"`` flags do)."""
    assert not isinstance(default, bool), "a bool flag would not round-trip: use choices"
    repeat = repeat or several
    assert not repeat or default == (), "a repeated flag's default is ()"
    flag = Flag(help, parse, show, tuple(choices) if choices else None, metavar, repeat,
                several)
    return dataclasses.field(default=default, metadata={_KEY: flag})  # type: ignore[no-any-return]


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _is_group(field: dataclasses.Field[Any]) -> bool:
    return isinstance(field.default_factory, type) and issubclass(field.default_factory, Settings)


def group(cls: type[T]) -> T:
    """A field holding a settings group (its flags join the parent's)."""
    return dataclasses.field(default_factory=cls)  # type: ignore[no-any-return]


class Settings:
    """Mixin for frozen dataclasses of :func:`setting` and :func:`group` fields."""

    TITLE: ClassVar[str | None] = None  # the --help section its flags appear under

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        target: Any = parser.add_argument_group(cls.TITLE) if cls.TITLE else parser
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if _is_group(field):
                field.default_factory.add_arguments(parser)  # type: ignore[misc,union-attr]
                continue
            flag: Flag = field.metadata[_KEY]
            default = field.default
            shown = "" if default in (None, (), "") else f" (default: {flag.show(default)})"
            many: dict[str, Any] = {"action": "extend", "nargs": "+"} if flag.several else \
                {"action": "append" if flag.repeat else "store"}
            target.add_argument(
                flag_name(field.name), dest=field.name, type=flag.parse,
                default=None if flag.repeat else default, choices=flag.choices,
                metavar=flag.metavar, help=(flag.help + shown).replace("%", "%%"), **many)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Self:
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if _is_group(field):
                values[field.name] = field.default_factory.from_args(args)  # type: ignore[misc,union-attr]
            elif field.metadata[_KEY].repeat:
                values[field.name] = tuple(getattr(args, field.name) or ())
            else:
                values[field.name] = getattr(args, field.name)
        return cls(**values)

    def to_args(self) -> list[str]:
        """Flags for every value that differs from its default, in declaration order."""
        out: list[str] = []
        for field in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, field.name)
            if _is_group(field):
                out += value.to_args()
                continue
            flag: Flag = field.metadata[_KEY]
            if value == field.default:
                continue
            # --flag=value: a value that starts with "-" (a model named "-chat") stays a value
            out += [f"{flag_name(field.name)}={flag.show(item)}"
                    for item in (value if flag.repeat else (value,))]
        return out

    @classmethod
    def flags(cls) -> list[str]:
        """Every flag this class defines, groups included (for docs and tests)."""
        out: list[str] = []
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if _is_group(field):
                out += field.default_factory.flags()  # type: ignore[misc,union-attr]
            else:
                out.append(flag_name(field.name))
        return out
