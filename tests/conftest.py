import os
import sys

# The distributed tests spawn processes that import these helpers by module name.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
