import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

AUTOLOAD_PTH = "ds_lowcomm_autoload.pth"


class build_py_with_autoload(build_py):
    """Also put ds_lowcomm_autoload.pth at the top of the wheel, so it lands in site-packages
    (data_files would put it under sys.prefix, where the interpreter never reads .pth files)."""

    def run(self):
        super().run()
        self.copy_file(AUTOLOAD_PTH, os.path.join(self.build_lib, AUTOLOAD_PTH))

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, AUTOLOAD_PTH)]


setup(
    name="ds_lowcomm",
    version="0.1.0",
    description="Low-communication data-parallel LLM training modes (sharded ZeRO-1, ACCO, DeMo, "
                "DES-LOC) inside DeepSpeed, switched by one JSON section",
    long_description=open("README.md").read() if os.path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_lowcomm", "ds_lowcomm.*"]),
    # the shipped DeepSpeed configs, addressable by name (ds_lowcomm.configs; ds_configs/ links there)
    package_data={"ds_lowcomm.configs": ["*.json", "hf/*.json"]},
    # The zero-code hook (see ds_lowcomm_autoload.py). Editable installs (pip -e) do not carry
    # it: install normally, or import ds_lowcomm in the script.
    py_modules=["ds_lowcomm_autoload"],
    cmdclass={"build_py": build_py_with_autoload},
    python_requires=">=3.9",
    # torch is not listed with a range that would pull a CUDA build on a CPU machine: install the
    # torch you want first (see README), then this package.
    # DeepSpeed: the series whose engine internals ds_lowcomm overrides (DEEPSPEED_VERSIONS in
    # ds_lowcomm/integration/initialize.py, checked at start-up); tested on 0.19.8.
    install_requires=["torch>=2.4", "deepspeed>=0.19.8,<0.20", "hjson", "packaging"],
    extras_require={
        "examples": ["transformers>=4.40", "accelerate>=1.0"],
        # datasets: the tests run a Trainer script written the way transformers' run_clm.py is
        "test": ["transformers>=4.40", "accelerate>=1.0", "datasets>=2.14", "pytest>=7"],
        # the bench's plots (loss against time, time and bytes per step); it writes its tables without
        "bench": ["matplotlib>=3.5"],
        "dev": ["transformers>=4.40", "accelerate>=1.0", "datasets>=2.14", "pytest>=7", "ruff"],
    },
    entry_points={"console_scripts": ["ds-lowcomm-export=ds_lowcomm.checkpoint.export:main",
                                      "ds-lowcomm-config=ds_lowcomm.configs:main"]},
    license="Apache-2.0",
)
