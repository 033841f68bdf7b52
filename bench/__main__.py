"""``python -m bench``: the studies and what each writes; ``python -m bench STUDY [args]`` runs
one (:mod:`bench.registry`)."""

import sys

from bench.registry import run

raise SystemExit(run(sys.argv[1:]))
