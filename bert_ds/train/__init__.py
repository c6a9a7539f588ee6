"""Training: the command line and loop (:mod:`.main`), the two-phase runner (:mod:`.phases`),
signals and stops (:mod:`.signals`), metrics (:mod:`.metrics`), and DeepSpeed's JIT-built
extensions (:mod:`.extensions`). ``python -m bert_ds.train`` runs :func:`.main.main`."""
