"""The slowest tests of one or more pytest JUnit files (scripts/test.sh names them when the CI tier
runs long): `python scripts/slowest_tests.py --top 10 a.xml b.xml`. A test's time is pytest's
(set-up, call and teardown: a module fixture's launch counts to the first test that used it)."""
import argparse
import xml.etree.ElementTree as ET


def slowest(paths, top):
    cases = []
    for path in paths:
        try:
            root = ET.parse(path).getroot()
        except (ET.ParseError, OSError):
            continue  # a pytest call that died before writing its file
        for case in root.iter("testcase"):
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            cases.append((float(case.get("time") or 0.0), name))
    return sorted(cases, reverse=True)[:top]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    for seconds, name in slowest(args.files, args.top):
        print(f"{seconds:8.1f} s  {name}")


if __name__ == "__main__":
    main()
