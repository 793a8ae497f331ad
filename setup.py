from setuptools import find_packages, setup

setup(
    name="ds_lowcomm",
    version="0.1.0",
    description="Low-communication data-parallel LLM training modes (sharded ZeRO-1, ACCO, DeMo, "
                "DES-LOC) inside DeepSpeed, switched by one JSON section",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_lowcomm", "ds_lowcomm.*"]),
    python_requires=">=3.9",
    # torch is not listed with a range that would pull a CUDA build on a CPU machine: install the
    # torch you want first (see README), then this package.
    install_requires=["torch>=2.4", "deepspeed==0.19.8", "hjson"],
    extras_require={
        "examples": ["transformers>=4.40"],
        "test": ["transformers>=4.40", "pytest>=7"],
        "dev": ["transformers>=4.40", "pytest>=7", "ruff"],
    },
    entry_points={"console_scripts": ["ds-lowcomm-export=ds_lowcomm.checkpoint:main"]},
)
