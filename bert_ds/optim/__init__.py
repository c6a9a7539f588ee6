"""Optimizer math and the learning-rate schedule: LAMB (:mod:`.lamb`) and StableAdamW
(:mod:`.stable_adamw`) on the per-parameter machinery they share (:mod:`.fragments`), the
schedule (:mod:`.schedule`), and the builders that turn a recipe into both (:mod:`.builders`)."""
