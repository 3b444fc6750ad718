"""Kubernetes DRA CEL device selectors, checked and evaluated as the scheduler does.

The scheduler compiles a selector with cel-go v0.26 in the environment of
``k8s.io/dynamic-resource-allocation/cel/compile.go``: the Kubernetes base environment
(``k8s.io/apiserver/pkg/cel/environment/base.go``, 1.36) plus the ``device`` variable and
``cel.bind``. This package has its own lexer and parser of CEL's grammar (cel-go's CEL.g4), its
own checker, validators and interpreter, so that what a user sees is what the scheduler reports:

- compile errors, all of them, sorted by position (``compilation failed: ERROR: <input>:1:53:
  undeclared reference to 'foo' (in container '')``, ``found no matching overload for '_+_'
  applied to '(string, int)'``, ``expected type 'int' but found 'string'`` at the element that
  breaks a homogeneous literal, ``invalid matches argument`` at a literal pattern that does not
  compile, format clauses checked against their arguments), ``must evaluate to bool or the unknown
  type, not string``, and what fails when the program is built (``program instantiation failed:``
  a literal ``find``/``findAll`` pattern, a conversion of a constant such as ``int(1e99)``);
- runtime errors (``no such key: index``, ``index out of bounds: 3``, ``no such overload: charAt(int,
  int)``, ``division by zero``, ``integer overflow``, ``insert failed: key 1 already exists``,
  ``operation cancelled: actual cost limit exceeded``);
- the runtime cost as cel-go's tracker counts it (interpreter/runtimecost.go, with the Kubernetes
  estimator library/cost.go and the sets and lists extensions' trackers): a macro costs what its
  expansion costs per element, constant literals and conversions are folded (``OptOptimize``), a
  conditional's branch identifier is not charged; the scheduler's limit (1,000,000) is enforced;
- no Python state in any message (messages are built here, capped to `MAX_MESSAGE`).

The functions: standard CEL (operators, ``size``, ``contains``, ``startsWith``, ``endsWith``,
``matches`` (RE2), conversions, ``has``/``all``/``exists``/``exists_one``/``map``/``filter``
macros); cel-go's strings extension version 2 (``charAt``, ``indexOf``, ``lastIndexOf``,
``lowerAscii``, ``upperAscii``, ``replace``, ``split``, ``substring``, ``trim``, ``join``,
``format``, ``strings.quote``); the sets extension; the lists extension version 3 (``slice``,
``flatten``, ``sort``, ``sortBy``, ``reverse``, ``distinct``, ``lists.range``); two-variable
comprehensions (``all``, ``exists``, ``existsOne``, ``transformList``, ``transformMap``,
``transformMapEntry``); ``cel.bind``; and the Kubernetes libraries lists (``isSorted``, ``sum``,
``min``, ``max``, ``indexOf``, ``lastIndexOf``), regex (``find``, ``findAll``), quantity and semver
(version 1, with ``normalize``).

Conformance (run outside CI: ``python -m benchmarks.cel_conformance --referee PATH``;
2026-12-02): the published cases of cel-spec (tests/simple/testdata: basic, comparisons,
conversions, fields, integer_math, lists, logic, macros, macros2, parse, plumbing, string,
string_ext, bindings_ext, fp_math; commit 508bd98), cel-go v0.26.0's extension tests (strings,
sets, bindings, comprehensions, lists, formatting) and k8s.io/apiserver v0.36.3's library tests
(quantity, semver, cost): 2,000 cases, 291 left out (protobuf messages, timestamps and durations,
optional types, Go-valued variables, the strings extension's version 4, the URL, IP, CIDR, authz,
format and jsonpatch libraries). Each of the 1,709 run is compared with a referee, the
scheduler's own engine: cel-go v0.26.0 built (Go 1.27.3, offline, from git mirrors) with
k8s.io/apiserver v0.36.3 (kubernetes/kubernetes 9419ebed), component-base v0.36.3 and
golang.org/x/text v0.33.0, in the selector environment of
k8s.io/dynamic-resource-allocation/cel/compile.go (base environment at
``DefaultCompatibilityVersion()``, 1.35 for a 1.36 binary; benchmarks/cel_conformance/referee).
Outcome and value agree on 1,708 of 1,709; error texts on 368 of the 369 errors both report;
runtime costs on the 1,340 values both compute (two vary from run to run in cel-go, which
iterates maps in random order). The one outcome and one text that differ are gaps below. Of the
291 left out, run anyway, 232 agree.

Gaps (complete; each named where it applies):

- Not evaluated, though the scheduler's environment has them: the URL, IP/CIDR, ``format.*`` and
  authz selector libraries, durations and timestamps (they compile; evaluation says explain does
  not evaluate them); optional types (``.?field``, ``[?key]``, ``{?key: v}``,
  ``optional.*``: a compile error here); the 1.36 ``includes`` function (behind the alpha
  DRAListTypeAttributes gate in the scheduler: ``undeclared reference`` here).
- Syntax errors name the offending token and its position as ANTLR does, without ANTLR's
  ``expecting {...}`` list, and only the first syntax error is reported.
- Expressions nesting deeper than about 100 levels report ``expression nests too deeply``;
  cel-go's limit is 250 per grammar rule (``expression recursion limit exceeded: 250``).
- A map literal whose keys are equal as Python values but distinct in CEL (``true`` and ``1``,
  ``1`` and ``1u``) keeps one entry (one conformance case).
- The authz library's functions are not declared, so a call of one on a receiver that does not
  compile reads ``undeclared reference to 'namespace'`` where cel-go reports ``found no matching
  overload for 'namespace' applied to '!error!.()'`` (one conformance case).
- ``format``'s ``%f``/``%e`` follow golang.org/x/text v0.33.0's en_US printer as the referee
  printed it (``1,234.500000``; ``1.052033\u00d710⁰³``, 6 digits whatever the precision);
  other locales are not modelled (Kubernetes sets none).
- Regular expressions run on RE2's Python binding: Go's regexp syntax is RE2's, but a pattern
  either engine alone rejects, and error texts beyond the common ones, can differ.
- The API server's admission-time *estimated* cost check is not repeated; only the runtime cost.

API (``dra-agent explain`` and the tests use it):

- ``matches(expression, device, driver=None) -> bool``: evaluate one selector on an
  `agent.core.model.Device` or a slice device dict (pass the slice's ``driver`` then).
- ``compile_check(expression)``: raise `CelCompileError` when the scheduler would not compile it.
- ``referenced_values(expression, device, driver)``: the attribute and capacity values the
  expression reads, as text (``<absent>`` when the device lacks them), to show why it was false.
- ``match_attribute(name, devices) -> bool``: the ``matchAttribute`` constraint.
- ``evaluate(expression, variables, declarations) -> Evaluation``: any expression, its value and
  cost (tools and the conformance runner).
- ``CelError``: compile errors (`CelCompileError`), runtime errors and non-bool results; its
  message is the scheduler's wording.

Modules: `errors` (limits, messages), `values` (CEL values), `ast` (the syntax tree), `lexer`
(tokens, literal escapes), `parser` (the grammar -> the syntax tree), `macros`, `types` and
`declarations` (the checker's types and the environment's overloads), `names` (qualified
variable names), `checker`, `validators`
(what the scheduler rejects after checking, and when building the program), `program` (compile,
cached), `evaluator` (the interpreter) and `cost` (cel-go's call costs), `library` (the functions,
one module per library), `device` (the ``device`` variable), `selectors` and `expressions` (the
API above).
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
