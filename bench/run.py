"""Run kvq's benchmark from a checkout: ``python bench/run.py [--quick] [--out DIR] ...``.

The same as ``python -m kvq bench``; see ``python bench/run.py --help``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvq.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
