"""``python -m ds_lowcomm.checkpoint export CHECKPOINT_DIR OUTPUT [--tag TAG]``: the same as
``ds-lowcomm-export CHECKPOINT_DIR OUTPUT [--tag TAG]``."""
import sys

from ds_lowcomm.checkpoint.export import main

if len(sys.argv) < 2 or sys.argv[1] != "export":
    sys.exit("usage: python -m ds_lowcomm.checkpoint export CHECKPOINT_DIR OUTPUT [--tag TAG]")
sys.exit(main(sys.argv[2:]))
