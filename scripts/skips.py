"""Fail when a test run skipped what it should have run (used by scripts/check-vllm.sh).

    python scripts/skips.py REPORT.xml MODULE.py...

REPORT.xml is pytest's `--junitxml`. Each MODULE must have run at least one test that
passed, and no skip may be an import failure: a module that cannot import what it needs
from the vLLM under check (`pytest.importorskip`) skips as a whole, and that must fail
the check. Other skips (a case one vLLM loop does not have, a GPU) are listed. Exits 1
naming each module that did not run and each import that failed.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter

IMPORT_FAILED = re.compile(
    r"could not import|no module named|cannot import|ImportError|ModuleNotFoundError"
    r"|needs vLLM|vLLM is not installed",
    re.IGNORECASE,
)
"""Skip reasons that say an import failed: pytest.importorskip's own wording ("could not
import 'x': No module named 'x'") and the reason the check's modules give it instead
("needs vLLM installed"). tests/project/test_skips_script.py holds every such reason in those
modules to this pattern."""


def _module(dotted: str) -> str:
    """The test module's path from a case's dotted class name, at any depth of folders
    (`tests.connector.test_adapter.TestX` -> `tests/connector/test_adapter.py`)."""
    parts = dotted.split(".")
    last = next((i for i, p in enumerate(parts) if p.startswith("test_")), 1)
    return "/".join(parts[: last + 1]) + ".py"


def main(report: str, modules: list[str]) -> int:
    passed: Counter[str] = Counter()
    bad: list[str] = []
    for case in ET.parse(report).getroot().iter("testcase"):
        dotted = case.get("classname") or case.get("name") or ""  # a collection skip: no class
        name = _module(dotted)
        skipped = case.find("skipped")
        if skipped is None and case.find("failure") is None and case.find("error") is None:
            passed[name] += 1
        elif skipped is not None:
            reason = f"{skipped.get('message', '')} {skipped.text or ''}".strip()
            line = f"{name}::{case.get('name')}: skipped: {reason}"
            if IMPORT_FAILED.search(reason):
                bad.append(line)
            else:
                print(f"skips: allowed: {line}")
    missing = [m for m in modules if passed[m] == 0]
    for m in missing:
        print(f"skips: {m} ran no test that passed", file=sys.stderr)
    for line in bad:
        print(f"skips: {line}", file=sys.stderr)
    if not (missing or bad):
        print(f"skips: every module ran ({sum(passed.values())} passed)")
    return 1 if missing or bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
