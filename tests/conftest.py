"""The whole suite: tests/support (fakes of other packages, toy nodes, helpers shared by
several tiers) is importable by its module names (`import fake_sglang`), as each test's own
folder is."""

import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))
