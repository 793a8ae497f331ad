"""The package as a user installs it: the wheel in a fresh virtual environment, used from a
directory outside the checkout. Training from a shipped config named by name, the export CLI
as documented, the ``zero_to_fp32.py`` every save writes, and a tiny bench.

The wheel is built from a copy of the checkout's files (no build output left in the checkout);
the fresh environment gets only the wheel (``pip install --no-deps``); its dependencies (torch,
DeepSpeed, transformers) are this environment's, reached through a path file, since a test cannot
download them. Nothing of the checkout is on its path: the test checks that ``ds_lowcomm`` comes
from the new environment's site-packages.
"""
import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "32", "--eval-iters", "1",
        "--log-every", "5"]


def _run(cmd, cwd, env, timeout=300):
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with the wheel built from this checkout installed (and nothing else of ours)."""
    base = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    source = base / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "bench_results"))
    # Without network access the build uses this environment's setuptools, where it has one.
    no_isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *no_isolation, "-q", "-w", str(base / "dist"),
          str(source)], base, env)
    (wheel,) = (base / "dist").glob("ds_lowcomm-*.whl")
    env_dir = base / "venv"
    _run([sys.executable, "-m", "venv", str(env_dir)], base, env)  # with pip (ensurepip: offline)
    python = env_dir / "bin" / "python"
    new_site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], base,
                         env).strip())
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], base, env)
    # Then this environment's dependencies, after the new site-packages (so the wheel's ds_lowcomm
    # wins; before the install, pip would have found this environment's copy and kept it).
    deps = [*site.getsitepackages(), site.getusersitepackages()]
    (new_site / "zz_dependencies.pth").write_text("\n".join(p for p in deps if os.path.isdir(p)) + "\n")
    work = base / "work"  # outside the checkout: nothing of it on the path
    work.mkdir()
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}")
    where = _run([python, "-c", "import ds_lowcomm; print(ds_lowcomm.__file__)"], work, env).strip().splitlines()[-1]
    assert where.startswith(str(new_site)), where
    return python, env_dir / "bin", work, env


def test_train_export_and_convert_from_the_wheel(venv):
    python, bin_dir, work, env = venv
    # 10 steps from a shipped config named by name; the script run as a module of the package.
    out = _run([python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "ds_lowcomm.examples.train",
                "--deepspeed", "zero1", "--max-steps", "10", "--eval-every", "0", "--save-dir", "ckpt", *TINY],
               work, env)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["steps"] == 10 and result["mode"] == "zero1" and result["world_size"] == 2
    assert "spans 200 steps (warm-up 20) and --max-steps is 10: the run stops before its schedule ends" in out
    # The export CLI as documented: ds-lowcomm-export CHECKPOINT_DIR OUT
    _run([bin_dir / "ds-lowcomm-export", "ckpt", "export/model.safetensors"], work, env)
    assert json.loads((work / "export" / "config.json").read_text())["model_type"] == "gpt2"
    # Stock DeepSpeed's habit: python zero_to_fp32.py inside the checkpoint directory.
    _run([python, "zero_to_fp32.py", ".", "fp32"], work / "ckpt", env)
    bin_state = torch.load(work / "ckpt" / "fp32" / "pytorch_model.bin")
    from safetensors.torch import load_file

    st_state = load_file(work / "export" / "model.safetensors")
    assert bin_state.keys() == st_state.keys() and all(torch.equal(bin_state[k], st_state[k]) for k in bin_state)
    assert all(v.dtype == torch.float32 for v in bin_state.values() if v.is_floating_point())


def test_a_tiny_bench_from_the_wheel(venv):
    python, _, work, env = venv
    _run([python, "-m", "ds_lowcomm.bench", "--modes", "zero1,ddp", "--model", "tiny", "--steps", "2",
          "--evals", "1", "--eval-iters", "1", "--micro-batch", "2", "--gas", "2", "--out", "bench"], work, env)
    runs = json.loads((work / "bench" / "results.json").read_text())["runs"]
    assert [r["mode"] for r in runs] == ["zero1", "ddp"] and all(r["steps"] == 2 for r in runs)
