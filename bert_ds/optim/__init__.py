"""Optimizer math and the learning-rate schedule: LAMB (:mod:`.lamb`) and the builders that
turn a recipe into an optimizer and schedule (:mod:`.builders`)."""
