"""Write the configuration reference, docs/configuration.md, from the schema (every key of the
"lowcomm" section and of each mode's options, as the validator checks them).

    python tools/config_reference.py           # rewrite docs/configuration.md
    python tools/config_reference.py --check   # exit 1 if the page is out of date
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, not an installed copy
from ds_lowcomm.config import reference_markdown  # noqa: E402
from ds_lowcomm.modes import MODES  # noqa: E402

PAGE = ROOT / "docs" / "configuration.md"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    text = reference_markdown(MODES)
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print(f"{PAGE} is out of date: run python tools/config_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
