import os
import sys

import pytest

# The distributed tests spawn processes that import these helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: every test is in exactly one tier: ``make test-fast`` runs the first two
TIERS = {
    "unit": "in one process, no ranks: arithmetic, formats, protocols with recording fakes",
    "ranks": "real gloo ranks, no DeepSpeed and no Hugging Face: collectives and the modes",
    "integration": "DeepSpeed engines, Hugging Face, user scripts, the bench and the tools",
}


def pytest_configure(config):
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: marked {sorted(tiers) or 'with no tier'}; mark it with "
                                    f"exactly one of {', '.join(TIERS)} (tests/conftest.py)")
