"""bert-ds: BERT pretraining on DeepSpeed, from raw text to a Hugging Face checkpoint.

The package, from the bottom layer up: a layer imports only the layers above it in this
list, and inside the library only what ``tests/test_layers.py`` (which checks all of it)
allows:

- :mod:`bert_ds.base`: errors and exit statuses, atomic writes, folder locks.
- :mod:`bert_ds.kernels` (the ``kernels/`` folder): fused CUDA ops, their references and
  the native fallbacks.
- :mod:`bert_ds.data_tools` (the ``data_tools/`` folder): raw text to token shards, offline.
- :mod:`bert_ds.ds_configs` (the ``ds_configs/`` folder): DeepSpeed engine JSON.
- The library: :mod:`bert_ds.model` (BERT, run unpadded), :mod:`bert_ds.config` (the typed,
  validated training configuration, which holds the model's), :mod:`bert_ds.loader` (the
  pretraining samples), :mod:`bert_ds.zero` (the one module that touches DeepSpeed's
  internals) and :mod:`bert_ds.optim` (LAMB and the schedule).
- :mod:`bert_ds.checkpoint`: checkpoints, resume rules, export and import of weights.
- :mod:`bert_ds.eval`: GLUE fine-tuning of exports.
- :mod:`bert_ds.train`: the training command, its loop and the two-phase runner.
- :mod:`bert_ds.tools`: commands around the system (bench, bundle, plot, demo, parity,
  the configuration reference of docs/).

``kernels/``, ``data_tools/`` and ``ds_configs/`` stay top-level folders of the repository
and are installed only under ``bert_ds`` (``bert_ds/kernels`` etc. are links to them), so
no generic top-level name is installed and a checkout imports the same names as a wheel.
They hold no ``__init__.py``, so that from the repository root an installed package of the
same name (Hugging Face's ``kernels``) is still the one ``import kernels`` finds.
"""
