"""Pretraining samples from token shards: the sample map, BERT's sample construction and
masking at load time, and the resumable, rank-sharded loader (:mod:`.pretraining`)."""
