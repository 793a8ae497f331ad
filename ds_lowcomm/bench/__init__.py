"""Every mode and its peers side by side, timed to a target loss: ``python -m ds_lowcomm.bench``.

Runs ``examples/train.py`` with the same model, data, seed, sampler and schedule under each of
``--modes`` (and each step budget of ``--budgets``) and writes ``results.json``, ``results.md`` and
plots into ``--out``:

- ``ideal``: the same per-rank work with no communication at all: W independent single-rank
  trainings at once on the same machine (the physical limit);
- ``ddp``: plain PyTorch ``DistributedDataParallel`` (``examples/train_ddp.py``: train.py's
  training with DDP's bucketed all-reduce, overlapped with the backward pass);
- ``ddp-powersgd``: the same with PyTorch's PowerSGD comm hook (``--powersgd-rank``, warm-up
  ``--powersgd-warmup``);
- ``deepspeed``: stock DeepSpeed ZeRO-1 (``ds_configs/deepspeed_zero1.json``);
- ``zero1``, ``acco``, ``dpu``, ``demo``, ``desloc``: ds_lowcomm modes (``ds_configs/<mode>*.json``);
  variants of a shipped config (``VARIANTS``): ``zero1-overlap`` (``"zero1": {"overlap": true}``),
  ``acco-fp32-estimate`` (``"acco": {"estimate_dtype": "fp32", "real_gather_dtype": "fp32"}``, the
  paper's rounds), ``acco-fp32-gather`` (``"acco": {"real_gather_dtype": "fp32"}``, the real round's
  parameters gathered whole), ``demo-overlap`` (``"demo": {"overlap": true, "lookahead": false}``),
  ``zero1-slowest`` (``"pace": "slowest"``: every rank computes every micro-batch it is handed),
  ``desloc-compressed`` (``"desloc": {"sync_topk": 1}``, moments never averaged),
  ``desloc-streamed`` (``"desloc": {"param_sync_delay": 12}``), ``desloc-muon``
  (``"desloc": {"inner_optimizer": "muon"}``), ``diloco``
  (DiLoCo, arXiv 2311.08105, as its users run it: ``desloc`` with the moments never averaged and an
  outer Nesterov step of lr 0.7, momentum 0.9 every H = ``param_sync_every`` steps);
- ``MODE:KEY=VALUE[:KEY=VALUE...]``: a mode with options of its own, applied after ``--set``'s, so
  one bench runs a mode at several settings side by side
  (``desloc-streamed:desloc.param_sync_delay=4,desloc-streamed:desloc.param_sync_delay=8``).

The headline is the training time until the validation loss reaches a target: ``--target``, or by
default the final validation loss of the synchronous baseline (``ddp``, else ``deepspeed``, else
``zero1``, at its longest budget), raised by ``TARGET_TOLERANCE`` (1e-4, relative) so that an
exact method that ends on the same loss up to float rounding counts as reaching it. Validation
runs at ``--evals`` fixed steps per run, off the training clock. The schedule follows the budget (the LR decays to the end of each run), and the
budget decides who wins: ``--budgets 100,200,400`` runs every mode, peers included, at each, and
each mode is reported at the budget that reached the target soonest.

``--regime`` sets up a link: ``fast`` (none), ``moderate`` (a DDP sync takes about one step of
compute), ``slow`` (about ten), ``uneven`` (rank 1 three times slower per micro-batch) and
``two-node`` (4 ranks as 2 nodes of 2: fast inside a node, a rate-limited link between them).
``uneven-trainer`` is ``uneven`` under the Hugging Face Trainer (``examples/finetune_hf.py``, which
hands every rank the same micro-batches) instead of ``examples/train.py``: modes ``zero1``
(``ds_configs/hf/zero1.json``, ``"pace": "fastest"`` by default: the slow rank runs some micro-batches
forward only), ``zero1-slowest`` (the same with ``"pace": "slowest"``: the slow rank sets the pace;
the synchronous baseline of the default target), ``acco`` (``ds_configs/hf/acco.json``),
``deepspeed`` (``hf/zero1.json`` without its ``"lowcomm"`` section: stock ZeRO-1) and ``ddp`` (the
Trainer with no DeepSpeed); default budgets ``TRAINER_BUDGETS``; the Trainer's own LR schedule
(warm-up a tenth, cosine) spans each budget.
``slow`` and ``two-node`` run ``demo`` and ``desloc`` with their slow-link configs
(``REGIME_CONFIGS``).
``moderate``, ``slow`` and ``two-node`` derive the rate from a short calibration run of this
machine's compute time (printed; ``--bandwidth`` overrides it).

``--bandwidth 100mbit`` runs all ranks in a private network namespace whose loopback is limited by
a token bucket (``tc ... tbf``; ``--latency`` adds netem delay), like a slow shared link. It needs
root; otherwise the bench says so and runs unlimited. Bytes are reported twice: the library's
accounting (none for the peers) and the namespace's interface counters (what really crossed the
link, for every run).
"""
