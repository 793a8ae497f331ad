"""The example training scripts, shipped with the package so the bench runs from an install.

``train.py`` (plain DeepSpeed loop), ``train_ddp.py`` (the same training under PyTorch DDP, a bench
peer) and ``finetune_hf.py`` (the Hugging Face Trainer; it never names ds_lowcomm, as a user's
script would not) are scripts: run them by path (``examples/`` in a source checkout is this
folder), or ``train.py`` as ``python -m ds_lowcomm.examples.train`` (``torchrun ... -m
ds_lowcomm.examples.train``) from an install. ``common.py`` holds what they share.
"""
