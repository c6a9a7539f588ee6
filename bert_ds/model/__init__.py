"""The model: BERT for pretraining run unpadded (:mod:`.bert`), the packed-token layout it
runs on (:mod:`.padding`), and the one FLOPs accounting every MFU figure uses (:mod:`.flops`)."""
