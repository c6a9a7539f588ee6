"""Downstream evaluation of pretrained models. ``python -m bert_ds.eval glue`` (:mod:`.glue`):
GLUE fine-tuning and its scores; the tasks and their data (:mod:`.glue_data`), the recipes
(:mod:`.recipe`), one fine-tuning run (:mod:`.finetune`), the metrics (:mod:`.metrics`)."""
