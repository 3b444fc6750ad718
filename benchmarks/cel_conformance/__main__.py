"""Run the published CEL test cases through agent.core.cel and print the agreement per suite.

    python -m benchmarks.cel_conformance [--cel-spec GITDIR@REF] [--cel-go GITDIR@REF]
        [--kubernetes GITDIR@REF] [--failures] [--suite NAME] [--referee PATH [--left-out]]

Each source is a bare git directory with a ref (as the search tool's ``fetch`` leaves them under
/work/.mirror) or a checkout directory. Defaults: cel-spec at HEAD, cel-go at v0.26.0 (the
version Kubernetes 1.36 vendors) and k8s.io/apiserver at v0.36.3 (Kubernetes 1.36).

``--referee PATH``: instead of the suites' own answers, compare with the cel-go referee built
from ``referee/`` (the scheduler's engine): outcome, value, error text and runtime cost per case.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

from benchmarks.cel_conformance import crosscheck, gosuite, specsuite
from benchmarks.cel_conformance.cases import Case, Outcome, run

_MIRROR = Path("/work/.mirror")
_CEL_GO_FILES = ("strings", "sets", "bindings", "comprehensions", "lists")
_KUBERNETES_FILES = ("quantity", "semver", "cost")


def _reader(source: str):  # type: ignore[no-untyped-def]
    """path -> text, from a checkout directory or ``GITDIR@REF``."""
    location, _, ref = source.partition("@")
    if Path(location, "HEAD").is_file():

        def read(path: str) -> str:
            done = subprocess.run(
                ["git", f"--git-dir={location}", "show", f"{ref or 'HEAD'}:{path}"],
                capture_output=True,
                text=True,
                check=True,
            )
            return done.stdout

        return read
    return lambda path: Path(location, path).read_text()


def collect(args: argparse.Namespace) -> list[Case]:
    cases: list[Case] = []
    spec = _reader(args.cel_spec)
    for name in specsuite.SUITES:
        cases += specsuite.cases(f"cel-spec {name}", spec(f"tests/simple/testdata/{name}.textproto"))
    cel_go = _reader(args.cel_go)
    for name in _CEL_GO_FILES:
        cases += gosuite.cases(f"cel-go ext {name}", cel_go(f"ext/{name}_test.go"))
    cases += gosuite.format_cases("cel-go ext formatting", cel_go("ext/formatting_test.go"))
    kubernetes = _reader(args.kubernetes)
    for name in _KUBERNETES_FILES:
        source = kubernetes(f"pkg/cel/library/{name}_test.go")
        cases += gosuite.cases(f"kubernetes {name}", source, kubernetes=True)
    return cases


def report(outcomes: list[Outcome], left_out: list[Case]) -> None:
    """One row per suite: agree (same value, or an error where one is expected), env (the
    scheduler's environment rejects what the suite evaluates), differ; stated error texts found
    in our messages; stated costs met."""
    rows: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        rows[o.case.suite].append(o)
    skipped: dict[str, int] = defaultdict(int)
    for c in left_out:
        skipped[c.suite] += 1
    header = ("suite", "cases", "left out", "run", "agree", "env", "differ", "messages", "cost")
    print(f"{header[0]:28} " + " ".join(f"{h:>8}" for h in header[1:]))
    totals = [0] * 10
    for suite in dict.fromkeys([*(c.suite for c in left_out), *rows]):
        done = rows.get(suite, [])
        agree = sum(o.agrees for o in done)
        env = sum(bool(o.environment) for o in done if not o.agrees)
        stated = [o for o in done if o.message_agrees is not None]
        msg_ok = sum(bool(o.message_agrees) for o in stated)
        costed = [o for o in done if o.case.cost is not None]
        cost_ok = sum(o.cost == o.case.cost for o in costed)
        n = len(done) + skipped[suite]
        row = [
            n,
            skipped[suite],
            len(done),
            agree,
            env,
            len(done) - agree - env,
            msg_ok,
            len(stated),
            cost_ok,
        ]
        row.append(len(costed))
        totals = [t + v for t, v in zip(totals, row, strict=True)]
        _row(suite, row)
    _row("total", totals)


def _reasons(title: str, reasons: list[str]) -> None:
    print(f"\n{title}:")
    for reason, count in sorted(Counter(reasons).items(), key=lambda item: -item[1]):
        print(f"  {count:5}  {reason}")


def _row(name: str, r: list[int]) -> None:
    cells = [*r[:6], f"{r[6]}/{r[7]}", f"{r[8]}/{r[9]}"]
    print(f"{name:28} " + " ".join(f"{c:>8}" for c in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cel_conformance", description=__doc__)
    parser.add_argument("--cel-spec", default=f"{_MIRROR}/google+cel-spec/repo@HEAD")
    parser.add_argument("--cel-go", default=f"{_MIRROR}/google+cel-go/repo@v0.26.0")
    parser.add_argument("--kubernetes", default=f"{_MIRROR}/kubernetes+apiserver/repo@v0.36.3")
    parser.add_argument("--failures", action="store_true", help="list each disagreement")
    parser.add_argument("--suite", default="", help="only suites whose name contains this")
    parser.add_argument("--referee", default="", help="the cel-go referee binary (see referee/README.md)")
    parser.add_argument("--left-out", action="store_true", help="with --referee: run the left-out cases too")
    args = parser.parse_args(argv)
    cases = [c for c in collect(args) if args.suite in c.suite]
    if args.referee:
        crosscheck.report(
            crosscheck.crosscheck([c for c in cases if not c.left_out], args.referee), args.failures
        )
        if args.left_out:
            print("\nLeft out above, run anyway (features explain does not evaluate, Go-valued variables):")
            crosscheck.report(
                crosscheck.crosscheck([c for c in cases if c.left_out], args.referee), args.failures
            )
        return 0
    left_out = [c for c in cases if c.left_out]
    outcomes = [run(c) for c in cases if not c.left_out]
    report(outcomes, left_out)
    _reasons("left out", [c.left_out for c in left_out])
    _reasons("env", [o.environment for o in outcomes if not o.agrees and o.environment])
    if args.failures:
        for o in outcomes:
            wrong_cost = o.case.cost is not None and o.cost != o.case.cost
            if (not o.agrees and not o.environment) or o.message_agrees is False or wrong_cost:
                want = f"error {o.case.error!r}" if o.case.expect == "error" else f"value {o.case.value!r}"
                cost = f" cost {o.cost} want {o.case.cost}" if wrong_cost else ""
                print(f"- {o.case.name}: {o.case.expr!r}\n    want {want}; got {o.got}{cost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
