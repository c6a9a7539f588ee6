"""DeepSpeed engine configurations (JSON files beside this one).

A package only so that wheels and offline bundles ship the JSON files;
``bert_ds.config`` finds them through this module's location.
"""
