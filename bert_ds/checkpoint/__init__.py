"""Weights in and out: atomic, verified checkpoints (:mod:`.store`), what a resume may change
(:mod:`.resume`), the Hugging Face export (:mod:`.export`) and ``--init-from`` (:mod:`.hf_import`)."""
