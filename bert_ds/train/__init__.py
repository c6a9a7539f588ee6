"""Training. ``python -m bert_ds.train`` runs :func:`.cli.main`.

- :mod:`.cli`: the command line (flags whose defaults are the config dataclasses') and the
  checks that need no process group.
- :mod:`.loop`: :func:`.loop.run`, the loop: open data, build the engine, resume, then per
  step: train, log, maybe validate, save.
- :mod:`.step`: one optimizer step and its accounting (skipped steps, the bad streak, the stop
  vote), testable without an engine.
- :mod:`.validation`: a held-out pass. :mod:`.checkpointer`: when and what the run saves.
  :mod:`.summary`: the closing summary. :mod:`.sample_log`: ``--log-samples``.
  :mod:`.profiling`: ``--profile-steps``. :mod:`.kernel_record`: ``OUTPUT/kernels.json``, what
  the model's ops run.
- :mod:`.session`: distributed start-up, signals (:mod:`.signals`), peer failures, the
  entry point's exit status (every status is defined in :mod:`bert_ds.base.errors`).
- :mod:`.faults`: the test hooks' one seam. (DeepSpeed's internals that the step relies on are
  in :mod:`bert_ds.zero`.) :mod:`.metrics`: metrics.jsonl, TensorBoard, the progress bar.
  :mod:`.extensions`: DeepSpeed's JIT-built extensions. :mod:`.phases`: the two-phase runner.
"""
