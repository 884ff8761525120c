"""python -m kvtier: the command-line interface (same as the kvtier command)."""

import sys

try:
    from kvtier.ops.cli import main
except KeyboardInterrupt:  # Ctrl-C while kvtier.ops.cli is imported, before main() handles it
    print("kvtier: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
