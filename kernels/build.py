"""Builds the fused CUDA extension ahead of time, self-checks it and times it against PyTorch.

    python -m bert_ds.kernels.build [--recheck] [--install DIR]

Runs the loader of ``kernels/_build.py`` now rather than at the first model
construction: the JIT build into ``~/.cache/bert-ds/kernels/<hash>`` (a later process
only loads it), the self-check on this GPU and the race of each op's candidates at a
BERT-Base's shapes at seq 128 (what ``kernels=auto`` will run for such a model; a model
of other shapes or another sequence length races its own when it is built), whose
verdicts it prints with the margins and each candidate's time per call by both clocks:
the host's wall time, which decides, and the device's in brackets. ``--recheck`` runs
the self-check and the race again. ``--install DIR`` also copies the built module into
DIR (e.g. site-packages), where the loader's "prebuilt" step finds it in processes that
have no compiler or no cache: useful for images. A prebuilt module is used only with the
sources and torch it was built for.

Exit status 0 when the extension loads and every op passed; 1 otherwise (the reason
is printed).
"""

import argparse
import logging
import shutil
import sys
from pathlib import Path

from bert_ds.kernels import _build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.kernels.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recheck", action="store_true", help="run the self-check again even if recorded")
    parser.add_argument("--install", type=Path, default=None, metavar="DIR",
                        help="copy the built module into DIR (a directory on sys.path)")
    args = parser.parse_args(argv)
    import torch  # with the ops the self-check runs: once the command line is read

    from bert_ds.kernels import choice

    logging.basicConfig(level=logging.INFO, format="%(message)s")

    extension, reason = _build.load_extension()
    if extension is None:
        print(f"fused CUDA kernels unavailable: {reason}", file=sys.stderr)
        return 1
    print(f"{_build.EXTENSION_NAME} {_build.source_hash()}: {extension.__file__}")
    if args.recheck:
        _build.verdict_path().unlink(missing_ok=True)
    verdicts = choice.op_verdicts()
    print(f"self-check on {torch.cuda.get_device_name()}:")
    for op, why in sorted(verdicts.items()):
        print(f"  {op:18s} {'ok' if not why else 'FAILED: ' + why}")
    print(f"kernels=auto on {torch.cuda.get_device_name()}, by wall time per call (recorded in "
          f"{_build.verdict_path()}):")
    for op, winner in sorted(choice.op_choices().items()):
        print(f"  {op:18s} {winner.describe()}")
    if args.install is not None:
        args.install.mkdir(parents=True, exist_ok=True)
        target = args.install / Path(extension.__file__).name
        shutil.copy2(extension.__file__, target)
        print(f"installed {target}")
    return 1 if any(verdicts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
