"""YAML text of a Kubernetes manifest, laid out for humans: the writer ``crd_schema`` uses for
``crds/llmservice.yaml``. The only Cleave module of the operator that imports PyYAML."""

from __future__ import annotations

from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)  # a list indented under its key


def _scalar(x: Any) -> bool:
    return not isinstance(x, dict | list)


def _list(dumper: _Dumper, data: list[Any]) -> Any:
    """Short lists on one line: scalars (``[name, key]``) and one-key mappings of scalars
    (``[{type: integer}, {type: string}]``)."""
    flat = all(_scalar(x) or (isinstance(x, dict) and len(x) == 1
                              and all(map(_scalar, x.values()))) for x in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


def _str(dumper: _Dumper, data: str) -> Any:
    """Prose (descriptions, messages, long CEL rules) folded, multi-line text literal."""
    prose = " " in data and (len(data) > 60 or ": " in data)
    style = "|" if "\n" in data else (">" if prose else None)
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(list, _list)
_Dumper.add_representer(str, _str)


def to_yaml(document: dict[str, Any]) -> str:
    """``document`` as YAML, keys in their insertion order; ``yaml.safe_load`` reads it back
    equal."""
    return str(yaml.dump(document, Dumper=_Dumper, sort_keys=False, width=80,
                         allow_unicode=True))
