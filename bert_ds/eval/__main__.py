"""``python -m bert_ds.eval glue|squad|ner|retrieval ...`` (also ``bert-ds-eval ...``)."""

import argparse
import sys

from bert_ds.base.errors import guarded
from bert_ds.base.interrupts import import_whole
from bert_ds.eval import glue, ner, retrieval, squad

COMMANDS = {"glue": (glue, "fine-tune on the GLUE tasks and report their dev scores"),
            "squad": (squad, "fine-tune on SQuAD v1.1 or v2.0 and report its dev scores"),
            "ner": (ner, "fine-tune on CoNLL-style named entities and report entity F1"),
            "retrieval": (retrieval, "fine-tune as a bi-encoder and score BEIR-format retrieval (nDCG@10, "
                                     "Recall@100, MRR@10)")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.eval", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (module, summary) in COMMANDS.items():
        module.add_arguments(commands.add_parser(name, help=summary, description=module.__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)

    def body() -> None:
        import_whole("bert_ds.zero")  # torch's initialisation: a Ctrl-C waits for it (bert_ds.base.interrupts)
        from bert_ds import zero

        zero.name_cpu_accelerator()  # before transformers' Trainer imports DeepSpeed
        COMMANDS[args.command][0].run(args)

    def kept() -> str:  # finished runs are on disk already: say how to go on
        done = len(list(args.output.glob("*/seed*.json")))
        return f"{done} finished run(s) kept in {args.output}; the same command goes on from them"

    return guarded(body, interrupted=kept)


if __name__ == "__main__":
    sys.exit(main())
