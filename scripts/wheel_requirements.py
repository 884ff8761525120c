"""Print a wheel's requirements for this interpreter (markers evaluated, extras left out), one per line.

    python scripts/wheel_requirements.py WHEEL [--drop NAME ...]
"""

from __future__ import annotations

import argparse
import email.parser
import re
import zipfile

from packaging.requirements import Requirement


def requirements(wheel: str, drop: set[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = email.parser.Parser().parsestr(zf.read(meta).decode())
    out = []
    for line in message.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if re.sub(r"[-_.]+", "-", req.name).lower() in drop:
            continue
        req.marker = None
        out.append(str(req))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("wheel")
    parser.add_argument("--drop", nargs="*", default=[])
    args = parser.parse_args()
    print("\n".join(requirements(args.wheel, {d.lower() for d in args.drop})))


if __name__ == "__main__":
    main()
