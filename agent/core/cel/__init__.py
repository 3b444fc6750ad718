"""Kubernetes DRA CEL device selectors, checked and evaluated as the scheduler does.

The scheduler compiles a selector with the environment of
``k8s.io/dynamic-resource-allocation/cel/compile.go``: the Kubernetes base environment
(``k8s.io/apiserver/pkg/cel/environment/base.go``) plus the ``device`` variable, the semver
library and ``cel.bind``. This package parses with cel-python's grammar, then type-checks and
evaluates with its own checker and interpreter so that what a user sees is what the scheduler
reports:

- compile errors (``compilation failed: ERROR: <input>:1:53: undeclared reference to 'foo'
  (in container '')``, ``found no matching overload for '_+_' applied to '(string, int)'``,
  ``must evaluate to bool or the unknown type, not string``);
- runtime errors (``no such key: index``, ``no such overload``, ``division by zero``,
  ``integer overflow``, ``operation cancelled: actual cost limit exceeded``);
- no Python state in any message (messages are built here, capped to `MAX_MESSAGE`).

The functions: standard CEL (operators, ``size``, ``contains``, ``startsWith``, ``endsWith``,
``matches`` (RE2), conversions, ``has``/``all``/``exists``/``exists_one``/``map``/``filter``
macros); cel-go's strings extension version 2 (``charAt``, ``indexOf``, ``lastIndexOf``,
``lowerAscii``, ``upperAscii``, ``replace``, ``split``, ``substring``, ``trim``, ``join``,
``format``, ``strings.quote``); the sets extension (``sets.contains``, ``sets.equivalent``,
``sets.intersects``); two-variable comprehensions (``all``, ``exists``, ``existsOne``,
``transformList``, ``transformMap``); ``cel.bind``; and the Kubernetes libraries lists
(``isSorted``, ``sum``, ``min``, ``max``, ``indexOf``, ``lastIndexOf``), regex (``find``,
``findAll``), quantity and semver (with the ``normalize`` argument of version 1).

Gaps (declared, so they compile, but evaluation reports that explain does not evaluate them):
the URL, IP/CIDR, format (``format.*``), image and authz libraries, durations and timestamps.
Optional types (``.?field``, ``[?key]``) do not parse. The runtime cost is counted per evaluated
node plus per-character costs of string functions, which approximates cel-go's tracker; the
scheduler's limit (1,000,000) is enforced with cel-go's message. The API server's admission-time
*estimated* cost check is not repeated.

API (``dra-agent explain`` and the tests use it):

- ``matches(expression, device, driver=None) -> bool``: evaluate one selector on an
  `agent.core.model.Device` or a slice device dict (pass the slice's ``driver`` then).
- ``compile_check(expression)``: raise `CelCompileError` when the scheduler would not compile it.
- ``referenced_values(expression, device, driver)``: the attribute and capacity values the
  expression reads, as text (``<absent>`` when the device lacks them), to show why it was false.
- ``match_attribute(name, devices) -> bool``: the ``matchAttribute`` constraint.
- ``CelError``: compile errors (`CelCompileError`), runtime errors and non-bool results; its
  message is the scheduler's wording.

Modules: `errors` (limits, cel-go's messages), `values` (CEL values), `ast` (the syntax tree),
`parser` (cel-python's parse tree -> the syntax tree), `types` and `declarations` (the checker's
types and the environment's overloads), `checker`, `program` (parse + check, cached),
`evaluator` (the interpreter and its cost), `library` (the functions, one module per library),
`device` (the ``device`` variable) and `selectors` (the API above).
"""

from __future__ import annotations

from agent.core.cel.errors import COST_LIMIT, MAX_MESSAGE, CelCompileError, CelError
from agent.core.cel.expressions import Evaluation, evaluate
from agent.core.cel.selectors import compile_check, match_attribute, matches, referenced_values
from agent.core.cel.values import CelQuantity, CelSemver
from agent.core.cel.values import _TypeValue as CelType
from agent.core.cel.values import _UInt as CelUint

__all__ = [
    "COST_LIMIT",
    "MAX_MESSAGE",
    "CelCompileError",
    "CelError",
    "CelQuantity",
    "CelSemver",
    "CelType",
    "CelUint",
    "Evaluation",
    "compile_check",
    "evaluate",
    "match_attribute",
    "matches",
    "referenced_values",
]
