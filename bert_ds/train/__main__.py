import sys

from bert_ds.train.main import main

sys.exit(main())
