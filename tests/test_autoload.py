"""Zero-code activation: an unmodified DeepSpeed script (no `import ds_lowcomm`) gets our engine
through the installed .pth hook, and fails loudly when the hook is switched off."""
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import workers
from dist import free_port

SCRIPT = '''
import json, os, sys
import deepspeed, torch
from transformers import GPT2Config, GPT2LMHeadModel

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=sys.argv[1])
losses = []
for step in range(4):
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
    loss = engine(x, labels=x).loss
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
# One file per rank: two ranks printing to one pipe can interleave their lines.
with open(f"result{os.environ['RANK']}.json", "w") as f:
    json.dump({"engine": type(engine).__name__, "modules": sorted(
        m for m in sys.modules if m.startswith("ds_lowcomm")), "losses": losses}, f)
'''


def _run(tmp_path, env_extra):
    script = tmp_path / "plain_deepspeed_script.py"
    script.write_text(SCRIPT)
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(workers.config("zero1")))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **env_extra)
    # Run from the temporary directory: the package comes from the installation, as for a user.
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(script), str(config)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_hook_is_installed():
    pth = Path(sysconfig.get_paths()["purelib"]) / "ds_lowcomm_autoload.pth"
    assert pth.is_file(), (f"{pth} is missing: install the package normally (`make install` or "
                           f"`pip install .`); editable installs do not carry the hook")


def test_unmodified_script_runs_our_engine(tmp_path):
    out = _run(tmp_path, {})
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads((tmp_path / f"result{rank}.json").read_text()) for rank in range(2)]
    for r in results:
        assert r["engine"] == "LowCommEngine" and "ds_lowcomm.engine" in r["modules"]
        assert r["losses"][-1] < r["losses"][0]


def test_disabled_autoload_fails_loudly(tmp_path):
    out = _run(tmp_path, {"DS_LOWCOMM_AUTOLOAD": "0"})
    assert out.returncode != 0
    assert not list(tmp_path.glob("result*.json"))  # never trained stock ZeRO-1
    assert 'has a "lowcomm" section but ds_lowcomm is not active (DS_LOWCOMM_AUTOLOAD=0)' in out.stderr
