"""The models: one folder per family (:mod:`.bert`, :mod:`.modernbert`), each exporting its
record; the table of families (:mod:`.families`); what they share: the packed-token layout
(:mod:`.padding`), the MLM decoder and loss (:mod:`.mlm`), and the one FLOPs accounting every
MFU figure uses (:mod:`.flops`)."""
