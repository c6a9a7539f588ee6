import sys

from bert_ds.train.cli import main

sys.exit(main())
