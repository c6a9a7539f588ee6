"""``python -m bert_ds.data_tools {build,verify,inspect,bench}``: raw text -> token shards, and checks.

    build    --input FILE... --output DIR (--vocab FILE | --train-vocab SIZE | --tokenizer PATH) [--overwrite]
             [--special-token KIND=TOKEN ...]  with --tokenizer: a special token its config does not name
             [--documents blank|file] [--join-wrapped-lines]
             [--workers N] [--split-sentences] [--[no-]lowercase] [--shard-tokens N]
             [--text-field NAME]     FILE: text (.gz), .jsonl(.gz), .parquet, a datasets
                                     folder, or hf:NAME[:CONFIG][@SPLIT]
             [--part I/N]            build part I of N into DIR/part-0000I-of-0000N (a launcher's
                                     rank and world size choose it when --part is not given)
    verify   DIR               exit 0 and "ok: N shards, T tokens", or 1 and one line per problem;
                               DIR may be a parent of parts: "ok: P parts, N shards, T tokens"
    inspect  DIR [--decode K]  manifest summary, optionally the first K documents as text;
                               of a parent of parts: the totals, then one line per part
    bench    [--corpus-mb MB] [--workers N] [--vocab-size V] [--files N] [--rounds K] [--json FILE]
                               the build's figures (build vs bare tokenizers and datasets, the
                               median of K alternating rounds; bytes/token, worker memory) beside
                               their goals; the loader's are python -m bert_ds.loader.bench

Bad input (a missing file, an empty corpus, conflicting options) prints one line
``error: ...`` to stderr and exits 2; argparse's own usage errors also exit 2. A build
stopped by Ctrl-C or SIGTERM prints one line and exits 128 + the signal (130, 143),
keeping its finished shards for a rerun to resume.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from bert_ds.base.errors import guarded


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0: {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _special_token(text: str) -> tuple[str, str]:
    kind, sep, token = text.partition("=")
    if not sep or not kind or not token:
        raise argparse.ArgumentTypeError(f"not KIND=TOKEN: {text!r}")
    return kind, token


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bert_ds.data_tools", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="{build,verify,inspect,bench}")
    for add_command in (_add_build, _add_verify, _add_inspect, _add_bench):
        add_command(sub)
    return parser


def _add_build(sub: argparse._SubParsersAction) -> None:
    from bert_ds.data_tools.build import DEFAULT_SHARD_TOKENS

    b = sub.add_parser(
        "build", help="tokenize raw text into shards",
        description="Tokenize raw text into token shards, the tokenizer files and manifest.json "
        "(written last). Text input: UTF-8 text or .gz, one sentence per line, a blank line between "
        "documents; WikiText ' = Title = ' lines start documents, section headings are dropped. "
        "Record input (.jsonl, .jsonl.gz, .parquet, a datasets save_to_disk folder, hf:NAME[:CONFIG][@SPLIT]): "
        "one document per record, its text in --text-field; its lines are always split into "
        "sentences (as --split-sentences does) and blank lines in it separate paragraphs, not documents. "
        "Records without the field, or whose field is not a string, are skipped and counted.",
    )
    b.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="inputs, read in order: text files (.gz allowed), .jsonl / .jsonl.gz, .parquet, "
                   "datasets save_to_disk folders, or hf:NAME[:CONFIG][@SPLIT] (a hub dataset, split "
                   "default train; needs the network or the local cache)")
    b.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field of JSONL, Parquet and datasets records that holds the text (default: text)")
    b.add_argument("--output", required=True, metavar="DIR",
                   help="dataset folder (created; a rerun of the same build resumes it or, finished, leaves it "
                        "as it is; anything else there is refused without --overwrite)")
    b.add_argument("--overwrite", action="store_true",
                   help="replace a dataset of other inputs or options in DIR, or build into a non-empty folder")
    b.add_argument("--vocab", metavar="FILE", help="an existing tokenizer, kept as it is: a Hugging Face tokenizer "
                   "folder, a WordPiece tokenizer.json, or a vocab.txt")
    b.add_argument("--train-vocab", type=_positive_int, metavar="SIZE",
                   help="train a WordPiece vocabulary of SIZE entries on the inputs")
    b.add_argument("--tokenizer", metavar="PATH",
                   help="any Hugging Face fast tokenizer, kept as it is (a BPE such as ModernBERT's, a Unigram, ...): "
                        "a folder holding tokenizer.json (and tokenizer_config.json, special_tokens_map.json), "
                        "or a tokenizer.json; lines keep their whitespace in the tokens")
    b.add_argument("--special-token", dest="special_tokens", type=_special_token, action="append", default=[],
                   metavar="KIND=TOKEN",
                   help="with --tokenizer: the token of KIND (cls, sep, pad, mask, unk) where the tokenizer's "
                        "config names none, e.g. --special-token mask='<mask>'; repeat for each")
    b.add_argument("--workers", type=_positive_int, default=None,
                   help="tokenizer processes (default: the CPUs available, shared among the build processes "
                   "a launcher started on this host; 1 tokenizes in this process); the output is the same for any N")
    b.add_argument("--split-sentences", action="store_true",
                   help="split lines into sentences after . ! ? followed by whitespace and an uppercase "
                   "letter, digit or quote")
    b.add_argument("--documents", choices=["blank", "file"], default="blank",
                   help="plain text: what ends a document: a blank line (BERT's convention; WikiText titles "
                        "too), or the end of the file (one document per file, blank lines between paragraphs)")
    b.add_argument("--join-wrapped-lines", dest="join_wrapped", action="store_true",
                   help="plain text broken by width, not by sentence (documentation, books): join each "
                        "paragraph's lines, then cut it into sentences")
    b.add_argument("--lowercase", action=argparse.BooleanOptionalAction, default=None,
                   help="lowercase and strip accents. With --train-vocab: on unless --no-lowercase. With "
                        "--vocab: the tokenizer's own normalizer is kept (a bare vocab.txt is cased exactly "
                        "when it holds cased tokens); a flag that disagrees with it is refused")
    b.add_argument("--shard-tokens", type=_positive_int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                   help=f"close a shard at the first document end after N tokens (default {DEFAULT_SHARD_TOKENS:,})")
    b.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    b.add_argument("--part", metavar="I/N",
                   help="build part I (0-based) of N into DIR/part-0000I-of-0000N; without it, a launcher's "
                        "rank and world size choose the part (torchrun, deepspeed, mpirun, MPICH, srun); "
                        "N = 1 is a plain build into DIR")
    b.set_defaults(func=_build)


def _add_verify(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser(
        "verify", help="check a dataset fully",
        description="Check the manifest, the tokenizer fingerprint and every shard fully (sizes, checksums, "
        "token ids < vocab size). Exit 0 and 'ok: N shards, T tokens', or 1 and one line per problem.",
    )
    v.add_argument("directory", metavar="DIR")
    v.set_defaults(func=_verify)


def _add_inspect(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser(
        "inspect", help="summarize a dataset",
        description="Print the manifest summary and sentence-length percentiles; optionally decode the "
        "first K documents.",
    )
    i.add_argument("directory", metavar="DIR")
    i.add_argument("--decode", type=int, default=0, metavar="K", help="print the first K documents as text")
    i.add_argument("--seq-len", type=_positive_int, default=128, metavar="S",
                   help="the training sequence length: warn when documents average fewer tokens")
    i.set_defaults(func=_inspect)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    n = sub.add_parser(
        "bench", help="measure the pipeline against its goals",
        description="On the bundled sample repeated to --corpus-mb MB, with N worker processes: build "
        "throughput vs bare tokenizers and vs a datasets map + save_to_disk pipeline, bytes on disk per "
        "token, and a build worker's peak RSS, each beside its goal. Speed figures are medians over K rounds "
        "that run every pipeline in turn. A few minutes at the defaults on 2 idle CPUs.",
    )
    n.add_argument("--corpus-mb", type=_positive_float, default=50.0, metavar="MB",
                   help="corpus size in MB (default 50)")
    n.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="processes for every pipeline (default: the CPUs available)")
    n.add_argument("--vocab-size", type=_positive_int, default=30522, metavar="V",
                   help="WordPiece vocabulary to train for the run (default 30,522, BERT's)")
    n.add_argument("--files", type=_positive_int, default=None, metavar="N",
                   help="also build the same corpus cut into about N files of varied size (log-uniform, "
                        "largest ~50x smallest) and report build / bare tokenizers for that layout")
    n.add_argument("--rounds", type=_positive_int, default=5, metavar="K",
                   help="measure every pipeline K times, in turn (default 5); speed figures are medians of K")
    n.add_argument("--json", metavar="FILE", help="also write every measurement and figure to FILE")
    n.set_defaults(func=_bench)


def _build(args: argparse.Namespace) -> int:
    from bert_ds.data_tools.build import BuildOptions, build
    from bert_ds.data_tools.partition import processes_per_host, resolve_part

    part = resolve_part(args.part)
    if args.workers is None and part.partitioned and part.origin != "--part":
        # N parts on one host share its CPUs (the output is the same for any worker count).
        args.workers = max(1, len(os.sched_getaffinity(0)) // processes_per_host())
    opts = BuildOptions(
        inputs=args.input, output=args.output, vocab=args.vocab, train_vocab=args.train_vocab,
        tokenizer=args.tokenizer, special_tokens=dict(args.special_tokens),
        split_sentences=args.split_sentences, lowercase=args.lowercase, part=part,
        shard_tokens=args.shard_tokens, progress=args.progress and part.index == 0, text_field=args.text_field,
        overwrite=args.overwrite, documents=args.documents, join_wrapped=args.join_wrapped,
        **({"workers": args.workers} if args.workers is not None else {}),
    )
    with _stop_signals_raise():
        try:
            result = build(opts)
        except _Interrupted as stop:
            label = f"{opts.part.label}: " if opts.part.partitioned else ""
            print(f"{label}stopped by {stop.signal.name}: finished shards are kept in {opts.part.folder(opts.output)}; "
                  "rerun the same command to resume", file=sys.stderr, flush=True)
            return 128 + stop.signal
    print(result.summary())
    return 0


class _Interrupted(BaseException):
    """A stop signal arrived (a BaseException, like KeyboardInterrupt: no handler for errors catches it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signal = signal.Signals(signum)


@contextlib.contextmanager
def _stop_signals_raise():
    """SIGINT (Ctrl-C) and SIGTERM end a build through its cleanup: the shard being written
    is removed, the workers are stopped, finished shards stay for the rerun to resume (R13).
    A second signal during that cleanup ends the process at once."""
    def stop(signum, frame):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL)
        raise _Interrupted(signum)

    saved = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def _verify(args: argparse.Namespace) -> int:
    from bert_ds.data_tools.verify import verify_parts

    problems, manifests = verify_parts(args.directory)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        return 1
    shards, tokens = sum(len(m.shards) for m in manifests), sum(m.totals["tokens"] for m in manifests)
    parts = f"{len(manifests)} parts, " if manifests[0].build.get("partition") else ""
    print(f"ok: {parts}{shards} shards, {tokens} tokens")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from bert_ds.data_tools.partition import dataset_folders, part_folders
    from bert_ds.data_tools.verify import inspect_dataset, inspect_parts

    if not part_folders(Path(args.directory)) or (Path(args.directory) / "manifest.json").is_file():
        inspect_dataset(args.directory, decode=args.decode, seq_len=args.seq_len)
    else:
        inspect_parts(args.directory, dataset_folders(args.directory), decode=args.decode, seq_len=args.seq_len)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from bert_ds.data_tools import bench

    workers = args.workers or len(os.sched_getaffinity(0))
    return bench.main(args.corpus_mb, workers, args.vocab_size, args.json, args.files, args.rounds)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return guarded(lambda: args.func(args))
    except BrokenPipeError:  # stdout closed early (`inspect DIR --decode 9 | head`): not a failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
