"""Print one combined pytest-style summary line for several JUnit XML reports.

Exit status 1 when any report has failures or errors, cannot be read, or when no
test ran at all.
"""

import sys
import xml.etree.ElementTree as ET


def main(paths: list[str]) -> int:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    unreadable = 0
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError) as err:
            print(f"{path}: no readable report ({err})")
            unreadable += 1
            continue
        suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
        for suite in suites:
            for key in totals:
                totals[key] += int(suite.get(key, 0))
            print(
                f"{path.rsplit('/', 1)[-1]}: {suite.get('tests')} tests, "
                f"{suite.get('failures')} failed, {suite.get('errors')} errors, "
                f"{suite.get('skipped')} skipped"
            )
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    line = f"{passed} passed, {failed} failed, {totals['skipped']} skipped"
    print(line + (f", {unreadable} unreadable reports" if unreadable else ""))
    return 1 if failed or unreadable or totals["tests"] == 0 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
