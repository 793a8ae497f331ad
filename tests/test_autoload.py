"""Zero-code activation: the installed .pth hook patches DeepSpeed however it is first found or
imported, and a "lowcomm" config never reaches a stock engine. Each case runs in a fresh
interpreter of the installed package (the whole scripts are in test_user_scripts.py)."""
import os
import subprocess
import sys
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import workers
from dist import run_ranks

OURS = "ds_lowcomm/integration/initialize.py"
# Each snippet reaches DeepSpeed a different way, then prints the file deepspeed.initialize is from.
FIRST_CONTACTS = {
    "find_spec then import": "import importlib.util; importlib.util.find_spec('deepspeed'); import deepspeed",
    "transformers and accelerate probes": (
        "from transformers.integrations.deepspeed import is_deepspeed_available as hf; "
        "from accelerate.utils import is_deepspeed_available as acc; assert hf() and acc(); import deepspeed"),
    "import_module": "import importlib; deepspeed = importlib.import_module('deepspeed')",
    "from-import": "from deepspeed import initialize; import deepspeed; assert initialize is deepspeed.initialize",
    "submodule first": "import deepspeed.runtime.engine; import deepspeed",
    "lazy loader": (
        "import importlib.util, sys; spec = importlib.util.find_spec('deepspeed'); "
        "spec.loader = importlib.util.LazyLoader(spec.loader); deepspeed = importlib.util.module_from_spec(spec); "
        "sys.modules['deepspeed'] = deepspeed; spec.loader.exec_module(deepspeed); deepspeed.__version__"),
}
pytestmark = pytest.mark.integration

DIRECT_ENGINE = """
import deepspeed, torch
from deepspeed.runtime.engine import DeepSpeedEngine
DeepSpeedEngine(args=None, model=torch.nn.Linear(2, 2), config={"train_batch_size": 1, "lowcomm": {"mode": "zero1"}})
"""


def _python(code: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    # From an empty directory: the package comes from the installation, as for a user.
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env)
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)


def test_hook_is_installed():
    pth = Path(sysconfig.get_paths()["purelib"]) / "ds_lowcomm_autoload.pth"
    assert pth.is_file(), (f"{pth} is missing: install the package normally (`make install` or "
                           f"`pip install .`); editable installs do not carry the hook")


def test_deepspeed_is_patched_however_it_is_first_reached(tmp_path):
    code = {name: f"{snippet}; print('FROM', deepspeed.initialize.__code__.co_filename)"
            for name, snippet in FIRST_CONTACTS.items()}
    with ThreadPoolExecutor(2) as pool:
        runs = dict(zip(code, pool.map(lambda c: _python(c, tmp_path), code.values())))
    for name, out in runs.items():
        assert out.returncode == 0, (name, out.stderr[-2000:])
        assert out.stdout.split("FROM ")[-1].strip().endswith(OURS), (name, out.stdout)


@pytest.mark.parametrize("env,message", [
    ({}, "reached DeepSpeedEngine, which would ignore it and train stock DeepSpeed. Build the engine "
         "with deepspeed.initialize(...)"),
    ({"DS_LOWCOMM_AUTOLOAD": "0"}, "reached DeepSpeedEngine, which would ignore it and train stock DeepSpeed: "
                                   "ds_lowcomm is not active (DS_LOWCOMM_AUTOLOAD=0). Unset DS_LOWCOMM_AUTOLOAD"),
], ids=["active", "disabled"])
def test_lowcomm_config_never_reaches_a_stock_engine(tmp_path, env, message):
    out = _python(DIRECT_ENGINE, tmp_path, **env)
    assert out.returncode != 0
    assert f'RuntimeError: this DeepSpeed config has a "lowcomm" section, but it {message}' in out.stderr, out.stderr[-2000:]


def _explicit_import(rank, world):
    import deepspeed

    from ds_lowcomm_autoload import inactive_reason  # the hook left DeepSpeed unpatched ...

    engine = workers.build_engine(workers.config("zero1"))  # ... until `import ds_lowcomm`
    x = workers.batch(0, 0, rank)
    engine.backward(engine(x, labels=x).loss)
    engine.step()
    return inactive_reason, type(engine).__name__, deepspeed.initialize.__code__.co_filename


def test_explicit_import_activates_when_the_hook_is_off():
    (reason, engine, source), = run_ranks(_explicit_import, 1, env={"DS_LOWCOMM_AUTOLOAD": "0"})
    assert reason == "DS_LOWCOMM_AUTOLOAD=0" and engine == "LowCommEngine" and source.endswith(OURS)
