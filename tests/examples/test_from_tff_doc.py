"""Every fedlang name in docs/from-tff.md's mapping table exists."""

import importlib
import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "from-tff.md"
PREFIXES = ("fedlang.", "fedlang.learning.", "fedlang.aggregators.", "fedlang.simulation.")


def resolve(dotted):
    """The object a dotted name (`fl.x`, `models.y`, `fedlang.a.b`) names, or None."""
    dotted = re.sub(r"^fl\.", "fedlang.", dotted)
    for prefix in ("", *PREFIXES):
        parts = (prefix + dotted).split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return obj
    return None


def test_every_fedlang_name_in_the_mapping_table_exists():
    rows = [line.split(" | ") for line in DOC.read_text().splitlines()
            if line.startswith("| `tff") or line.startswith("| TFF's") or line.startswith("| FedAvg")]
    assert len(rows) > 25
    names = set()
    for row in rows:
        for code in re.findall(r"`([^`]+)`", row[1]):
            head = code.split("(")[0].strip()
            if re.fullmatch(r"[A-Za-z_][\w.]*", head) and "." in head and "*" not in head:
                names.add(head)
    missing = sorted(n for n in names if resolve(n) is None)
    assert len(names) > 30 and not missing, missing
