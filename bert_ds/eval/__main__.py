"""``python -m bert_ds.eval glue ...`` (also ``bert-ds-eval glue ...``)."""

import argparse
import sys

from bert_ds.base.errors import guarded
from bert_ds.eval import glue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.eval", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    glue.add_arguments(commands.add_parser("glue", help="fine-tune on the GLUE tasks and report their dev scores",
                                           description=glue.__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)

    def body() -> int | None:
        try:
            glue.run(args)
        except KeyboardInterrupt:  # finished runs are on disk already: say how to go on
            done = len(list(args.output.glob("*/seed*.json")))
            print(f"\ninterrupted: {done} finished run(s) kept in {args.output}; the same command goes on from them",
                  file=sys.stderr, flush=True)
            return 130
        return None

    return guarded(body)


if __name__ == "__main__":
    sys.exit(main())
