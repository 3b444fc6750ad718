"""The scheduler's CEL environment: every function's overloads, by library, and the declared gaps.

Standard CEL, cel-go's strings (version 2), sets and lists (version 3) extensions, the Kubernetes
lists, regex, quantity and semver (version 1) libraries. `_UNSUPPORTED` lists what the environment
declares but explain does not evaluate (URL, IP/CIDR, format, authz selectors, durations and
timestamps).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.core.cel.types import _COMPARABLE, _NUMERIC, _QTY, _SEMVER, _T


@dataclass(frozen=True)
class _Overload:
    member: bool
    params: tuple[_T, ...]
    result: _T


def _o(member: bool, result: _T, *params: _T) -> _Overload:
    return _Overload(member, params, result)


_A = "A"  # a type parameter
_LIST_A = ("list", _A)
_MAP_AB = ("map", _A, "B")


def _declarations() -> dict[str, list[_Overload]]:
    d: dict[str, list[_Overload]] = {}

    def add(name: str, *overloads: _Overload) -> None:
        d.setdefault(name, []).extend(overloads)

    # Standard operators.
    for op in ("_+_",):
        add(
            op,
            *(_o(False, t, t, t) for t in (*_NUMERIC, "string", "bytes")),
            _o(False, _LIST_A, _LIST_A, _LIST_A),
        )
    for op in ("_-_", "_*_", "_/_"):
        add(op, *(_o(False, t, t, t) for t in _NUMERIC))
    add("_%_", _o(False, "int", "int", "int"), _o(False, "uint", "uint", "uint"))
    add("-_", _o(False, "int", "int"), _o(False, "double", "double"))
    add("!_", _o(False, "bool", "bool"))
    for op in ("_==_", "_!=_"):
        add(op, _o(False, "bool", _A, _A))
    for op in ("_<_", "_<=_", "_>_", "_>=_"):
        add(op, *(_o(False, "bool", a, b) for a in _NUMERIC for b in _NUMERIC))
        add(op, *(_o(False, "bool", t, t) for t in ("string", "bytes", "bool")))
        # cel-go lets null stand for a timestamp or duration operand: `null < null` compiles.
        add(op, _o(False, "bool", "null_type", "null_type"))
    add("@in", _o(False, "bool", _A, _LIST_A), _o(False, "bool", _A, _MAP_AB))
    add("_[_]", _o(False, _A, _LIST_A, "int"), _o(False, "B", _MAP_AB, _A))
    for op in ("_&&_", "_||_"):
        add(op, _o(False, "bool", "bool", "bool"))
    add("_?_:_", _o(False, _A, "bool", _A, _A))
    # Standard functions.
    for t in ("string", "bytes", _LIST_A, _MAP_AB):
        add("size", _o(False, "int", t), _o(True, "int", t))
    for name in ("contains", "startsWith", "endsWith"):
        add(name, _o(True, "bool", "string", "string"))
    add("matches", _o(False, "bool", "string", "string"), _o(True, "bool", "string", "string"))
    add("int", *(_o(False, "int", t) for t in ("int", "uint", "double", "string")))
    add("uint", *(_o(False, "uint", t) for t in ("int", "uint", "double", "string")))
    add("double", *(_o(False, "double", t) for t in ("int", "uint", "double", "string")))
    add("string", *(_o(False, "string", t) for t in ("int", "uint", "double", "string", "bytes", "bool")))
    add("bytes", _o(False, "bytes", "bytes"), _o(False, "bytes", "string"))
    add("bool", _o(False, "bool", "bool"), _o(False, "bool", "string"))
    add("dyn", _o(False, "dyn", _A))
    add("type", _o(False, "type", _A))
    # cel-go strings extension, version 2.
    add("charAt", _o(True, "string", "string", "int"))
    for name in ("indexOf", "lastIndexOf"):
        add(name, _o(True, "int", "string", "string"), _o(True, "int", "string", "string", "int"))
    for name in ("lowerAscii", "upperAscii", "trim"):
        add(name, _o(True, "string", "string"))
    add(
        "replace",
        _o(True, "string", "string", "string", "string"),
        _o(True, "string", "string", "string", "string", "int"),
    )
    add(
        "split",
        _o(True, ("list", "string"), "string", "string"),
        _o(True, ("list", "string"), "string", "string", "int"),
    )
    add("substring", _o(True, "string", "string", "int"), _o(True, "string", "string", "int", "int"))
    add("join", _o(True, "string", ("list", "string")), _o(True, "string", ("list", "string"), "string"))
    add("format", _o(True, "string", "string", ("list", "dyn")))
    add("strings.quote", _o(False, "string", "string"))
    # cel-go sets extension.
    for name in ("sets.contains", "sets.equivalent", "sets.intersects"):
        add(name, _o(False, "bool", _LIST_A, _LIST_A))
    # Kubernetes lists library: the element types each function is declared for.
    add("isSorted", *(_o(True, "bool", ("list", t)) for t in _COMPARABLE))
    add("sum", *(_o(True, t, ("list", t)) for t in _NUMERIC))
    for name in ("min", "max"):
        add(name, *(_o(True, t, ("list", t)) for t in _COMPARABLE))
    for name in ("indexOf", "lastIndexOf"):
        add(name, _o(True, "int", _LIST_A, _A))
    # cel-go lists extension, version 3 (sortBy is a macro).
    add("slice", _o(True, _LIST_A, _LIST_A, "int", "int"))
    add("flatten", _o(True, _LIST_A, ("list", _LIST_A)), _o(True, ("list", "dyn"), ("list", "dyn"), "int"))
    add("sort", *(_o(True, ("list", t), ("list", t)) for t in _COMPARABLE))
    for name in ("reverse", "distinct"):
        add(name, _o(True, _LIST_A, _LIST_A))
    add("lists.range", _o(False, ("list", "int"), "int"))
    # Kubernetes regex library.
    add("find", _o(True, "string", "string", "string"))
    add(
        "findAll",
        _o(True, ("list", "string"), "string", "string"),
        _o(True, ("list", "string"), "string", "string", "int"),
    )
    # Kubernetes quantity library.
    add("quantity", _o(False, _QTY, "string"))
    add("isQuantity", _o(False, "bool", "string"))
    add("sign", _o(True, "int", _QTY))
    add("asInteger", _o(True, "int", _QTY))
    add("asApproximateFloat", _o(True, "double", _QTY))
    add("isInteger", _o(True, "bool", _QTY))
    for name in ("add", "sub"):
        add(name, _o(True, _QTY, _QTY, _QTY), _o(True, _QTY, _QTY, "int"))
    # Quantity and semver comparisons.
    for t in (_QTY, _SEMVER):
        add("isGreaterThan", _o(True, "bool", t, t))
        add("isLessThan", _o(True, "bool", t, t))
        add("compareTo", _o(True, "int", t, t))
    # Kubernetes semver library, version 1.
    add("semver", _o(False, _SEMVER, "string"), _o(False, _SEMVER, "string", "bool"))
    add("isSemver", _o(False, "bool", "string"), _o(False, "bool", "string", "bool"))
    for name in ("major", "minor", "patch"):
        add(name, _o(True, "int", _SEMVER))
    return d


_DECLS = _declarations()

_UNSUPPORTED = frozenset(
    {
        # Kubernetes URL, IP, CIDR, format and authz selector libraries; durations and timestamps.
        # (No image library and no authorizer variable: base.go and compile.go declare none.)
        "url", "isURL", "getScheme", "getHost", "getHostname", "getPort", "getEscapedPath", "getQuery",
        "ip", "isIP", "family", "isUnspecified", "isLoopback", "isLinkLocalMulticast",
        "isLinkLocalUnicast", "isGlobalUnicast", "isCanonical", "cidr", "isCIDR", "containsIP",
        "containsCIDR", "masked", "prefixLength", "validate", "named", "duration", "timestamp",
        "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear", "getFullYear", "getMonth",
        "getHours", "getMilliseconds", "getMinutes", "getSeconds", "fieldSelector", "labelSelector",
    }
)  # fmt: skip
