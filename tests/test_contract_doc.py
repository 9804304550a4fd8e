"""docs/CONTRACT.md cites, for every rule, the module that implements it and the test that proves it:
every cited path must exist and every cited test must be defined, so a move or a rename breaks this
test instead of leaving the contract pointing at nothing."""
import os
import re

from conftest import ROOT

CONTRACT = os.path.join(ROOT, "docs", "CONTRACT.md")
TEST_FILE = re.compile(r"^(?:tests/)?(test_\w+\.py)(?:::(\w+)(\*?))?$")
TEST_NAME = re.compile(r"^::(\w+)(\*?)$")
MODULE = re.compile(r"^[\w./]+(?:\.py|/)$")


def _defined(test_file: str, name: str, prefix: bool) -> bool:
    with open(os.path.join(ROOT, "tests", test_file)) as f:
        names = re.findall(r"^def (test_\w+)", f.read(), flags=re.M)
    return any(n.startswith(name) for n in names) if prefix else name in names


def _module_exists(path: str, last_dir: str) -> bool:
    candidates = [os.path.join(ROOT, path), os.path.join(ROOT, "mindspeed_tp", path)]
    if "/" not in path.rstrip("/"):  # a bare file name: beside the module cited before it
        candidates.append(os.path.join(last_dir, path))
    return any(os.path.exists(c) for c in candidates)


def contract_rows() -> list:
    with open(CONTRACT) as f:
        return [line for line in f if line.startswith("|")]


def citations(row: str):
    """(kind, token, test file, test name, prefix) of each citation of a row, in order: kind "test"
    (a test file, or a test of the file cited before it; name None for a whole file) or "module"."""
    test_file = None
    for token in re.findall(r"`([^`]+)`", row):
        token = token.strip()
        m = TEST_FILE.match(token)
        if m:
            test_file = m.group(1)
            yield "test", token, test_file, m.group(2), bool(m.group(3))
            continue
        m = TEST_NAME.match(token)
        if m:
            yield "test", token, test_file, m.group(1), bool(m.group(2))
            continue
        if MODULE.match(token) and not token.startswith("."):
            yield "module", token, None, None, False


def test_every_path_and_test_the_contract_cites_exists():
    missing, cited = [], 0
    for row in contract_rows():
        last_dir = os.path.join(ROOT, "mindspeed_tp")
        for kind, token, test_file, name, prefix in citations(row):
            cited += 1
            if kind == "test":
                if test_file is None or not os.path.exists(os.path.join(ROOT, "tests", test_file)):
                    missing.append(f"{test_file}{token}" if token.startswith("::") else token)
                elif name and not _defined(test_file, name, prefix):
                    missing.append(f"{test_file}{token}" if token.startswith("::") else token)
            elif not _module_exists(token, last_dir):
                missing.append(token)
            else:
                for base in (ROOT, os.path.join(ROOT, "mindspeed_tp")):
                    if os.path.exists(os.path.join(base, token)):
                        last_dir = os.path.dirname(os.path.join(base, token.rstrip("/")))
    assert cited > 100, f"only {cited} citations parsed: the table format changed?"
    assert missing == [], f"docs/CONTRACT.md cites what does not exist: {missing}"
