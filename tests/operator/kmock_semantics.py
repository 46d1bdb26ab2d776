"""Kubernetes API semantics for the kmock emulator: Status errors, patches and selectors.

``merge`` (merge and strategic-merge patches), ``json_patch`` (RFC 6902), ``selects`` (label and
field selectors), plus the small helpers ``dig`` and ``now``; used by ``kmock_emulator``.
"""

from __future__ import annotations

import copy
import datetime
import re
from collections.abc import Callable
from typing import Any

Obj = dict[str, Any]
TERM = re.compile(r"^(!?)\s*([\w./-]+)\s*(?:(==|=|!=)\s*([\w./-]*)|\s+(in|notin)\s*\((.*)\))?$")
MERGE_KEYS = ("name", "containerPort", "port", "mountPath", "type", "ip")


class Fail(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(code, reason, message)
        self.code, self.reason, self.message = code, reason, message


def merge(old: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 merge patch; ``strategic`` also merges lists of dicts by a well-known key."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(old) if isinstance(old, dict) else {}
    for key, val in patch.items():
        items = val + out.get(key, []) if isinstance(val, list) else []
        mk = next((k for k in MERGE_KEYS if items and all(
            isinstance(i, dict) and k in i for i in items)), None)
        if strategic and key.startswith("$"):
            continue  # $patch/$setElementOrder/$retainKeys directives are not emulated
        elif val is None:
            out.pop(key, None)
        elif strategic and mk and isinstance(out.get(key), list):
            merged = {item[mk]: item for item in out[key]}
            for item in val:
                merged[item[mk]] = merge(merged.get(item[mk]), item, True)
                if item.get("$patch") == "delete":
                    del merged[item[mk]]
            out[key] = list(merged.values())
        else:
            out[key] = merge(out.get(key), val, strategic)
    return out


def json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 add/replace/remove/test; a failed ``test`` is a 422, as kopf expects."""
    doc = copy.deepcopy(doc)
    try:
        for op in ops:
            *parents, last = [p.replace("~1", "/").replace("~0", "~")
                              for p in op["path"].split("/")[1:]]
            node: Any = doc
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            idx: Any = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
            current = node.get(idx) if isinstance(node, dict) else node[idx]
            if op["op"] == "test" and current != op["value"]:
                raise Fail(422, "Invalid", f"test failed at {op['path']}")
            elif op["op"] == "remove":
                del node[idx]
            elif op["op"] == "add" and isinstance(node, list):
                node.insert(idx, op["value"])
            elif op["op"] in ("add", "replace"):
                node[idx] = op["value"]
    except (KeyError, IndexError, ValueError, TypeError) as e:
        raise Fail(422, "Invalid", f"cannot apply the JSON patch: {e!r}") from e
    return doc


def selects(selector: str, get: Callable[[str], Any]) -> bool:
    """Evaluate a label/field selector (``a=b,c!=d,e in (x,y),f notin (z),g,!h``)."""
    for term in filter(None, (t.strip() for t in re.split(r",(?![^()]*\))", selector))):
        if not (m := TERM.match(term)):
            raise Fail(400, "BadRequest", f"unable to parse selector {term!r}")
        neg, key, op, val, setop, vals = m.groups()
        have, choices = get(key), {v.strip() for v in (vals or "").split(",")}
        have = None if have is None else str(have)
        if not (have == val if op in ("=", "==") else have != val if op == "!=" else
                have in choices if setop == "in" else have not in choices if setop else
                (have is None) == bool(neg)):
            return False
    return True


def dig(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

