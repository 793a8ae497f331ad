"""The README and docs/ against the code: the configuration reference is the schema's, every
command they show uses flags its script declares and config files that exist, every relative
link leads somewhere, and the README stays a front door (at most 300 lines)."""
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
PKG = ROOT / "ds_lowcomm"
#: how a command names a script of ours -> the file whose argparse declarations it must match
SCRIPTS = {
    "train.py": PKG / "examples" / "train.py",
    "ds_lowcomm.examples.train": PKG / "examples" / "train.py",
    "train_ddp.py": PKG / "examples" / "train_ddp.py",
    "finetune_hf.py": PKG / "examples" / "finetune_hf.py",
    "ds_lowcomm.bench": PKG / "bench" / "cli.py",
    "ds_lowcomm.bench.checkpoint": PKG / "bench" / "checkpoint.py",
    "ds-lowcomm-export": PKG / "checkpoint" / "export.py",
    "ds_lowcomm.checkpoint": PKG / "checkpoint" / "export.py",
    "zero_to_fp32.py": PKG / "checkpoint" / "export.py",
    "ds-lowcomm-config": PKG / "configs" / "__init__.py",
    "ds_lowcomm.configs": PKG / "configs" / "__init__.py",
    "gpu_check.py": ROOT / "tools" / "gpu_check.py",
    "config_reference.py": ROOT / "tools" / "config_reference.py",
    "kill_during_save.py": ROOT / "tests" / "kill_during_save.py",
}
SHELL_END = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}


def _flags(script: Path) -> set:
    """Every option string ``add_argument`` declares in ``script`` (aliases included), and --help."""
    found = {"--help", "-h"}
    for call in re.finditer(r"add_argument\(((?:\s*\"-[^\"]+\",)+)", script.read_text()):
        found.update(re.findall(r"\"(-[^\"]+)\"", call.group(1)))
    return found


def _commands(page: Path):
    """(line number, tokens) of every shell line in the page's fenced code blocks."""
    in_block, lang, pending, start = False, "", "", 0
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block, lang = (not in_block), line.strip()[3:]
            continue
        if not in_block or lang not in ("", "bash", "sh", "shell", "console"):
            continue
        text = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not pending:
            start = n
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        text, pending = pending + text, ""
        if text.strip():
            try:
                yield start, shlex.split(text.replace("$(", "(").replace("`", ""))
            except ValueError:
                yield start, text.split()


def _script_and_args(tokens):
    for i, tok in enumerate(tokens):
        name = tok.rsplit("/", 1)[-1]
        if tok == "-m" and i + 1 < len(tokens) and tokens[i + 1] in SCRIPTS:
            return tokens[i + 1], tokens[i + 2:]
        if name in SCRIPTS and not tok.startswith("-"):
            return name, tokens[i + 1:]
    return None, []


def test_the_configuration_reference_is_the_schema():
    from ds_lowcomm.config import reference_markdown
    from ds_lowcomm.modes import MODES

    page = ROOT / "docs" / "configuration.md"
    assert page.is_file() and page.read_text() == reference_markdown(MODES), \
        "docs/configuration.md differs from the schema: run python tools/config_reference.py"


def test_every_documented_command_parses():
    """Flags each documented command passes to one of our scripts are flags it declares; config
    files it names exist (in the checkout, or shipped by that name)."""
    from ds_lowcomm import configs

    problems, checked = [], 0
    for page in PAGES:
        for line, tokens in _commands(page):
            script, args = _script_and_args(tokens)
            if script is None:
                continue
            checked += 1
            known = _flags(SCRIPTS[script])
            where = f"{page.relative_to(ROOT)}:{line}"
            for i, tok in enumerate(args):
                if tok in SHELL_END:
                    break
                if i and args[i - 1] == "--deepspeed" and not tok.startswith(("-", "(", "$", "/")) \
                        and "<" not in tok and tok.isascii() and tok.upper() != tok \
                        and not (ROOT / tok).is_file() and configs.path(tok) is None:
                    problems.append(f"{where}: --deepspeed {tok}: no such file or shipped config")
                flag = tok.split("=")[0]
                if flag.startswith("--") and flag not in known:
                    problems.append(f"{where}: {script} has no {flag}")
                if tok.endswith(".json") and "/" in tok and "<" not in tok and not tok.startswith(("/", "$", "(")) \
                        and not (ROOT / tok).is_file() and configs.path(tok) is None:
                    problems.append(f"{where}: {tok} does not exist")
    assert problems == []
    assert checked >= 10, f"only {checked} commands found: is the extraction broken?"


def test_relative_links_lead_somewhere():
    problems = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}")
    assert problems == []


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; depth belongs in docs/"


def test_the_checker_sees_a_bad_flag(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\ntorchrun --nproc_per_node 2 examples/train.py --deepspeed zero1 \\\n"
                    "    --max-step 10\n```\n")
    ((line, tokens),) = list(_commands(page))
    script, args = _script_and_args(tokens)
    assert (line, script) == (2, "train.py") and "--max-step" not in _flags(SCRIPTS[script])
    assert "--max-steps" in _flags(SCRIPTS[script]) and "--slow-rank" in _flags(SCRIPTS["ds_lowcomm.bench"])
