"""``python -m bert_ds.data_tools bench``: the data pipeline's figures beside their goals.

Everything is measured in one run, on one corpus, with the same number of worker
processes (``--workers N``, default: the CPUs available), one measurement at a time, in
``--rounds K`` rounds (default 5): each round runs every pipeline once on each layout, in an
order that turns from round to round, so that a change in the machine's load falls on every
pipeline alike. A speed figure is the median over the rounds of the ratio measured within a
round; its spread (min-max) is printed beside it.

1. ``data_tools build`` throughput (MB/s of input, tokens/s) with ``--vocab`` given and
   ``--split-sentences`` (the corpus holds paragraphs), against bare ``tokenizers``
   (goal: build/bare >= 0.90). Fairness: both run N spawned single-threaded tokenizer
   processes built from the same ``tokenizer.json`` and encode with
   ``encode_batch_fast`` in batches of ``CHUNK_CHARS`` characters, and both are timed
   from spawning their processes to their last result. The bare side does nothing
   else: each process reads its own 1/N of the file's lines, encodes the non-blank
   ones and counts tokens. The build also reads and cleans in its main process, splits
   sentences, ships ids back and writes, hashes and verifies shards: that is the
   overhead the ratio shows. Where it goes is printed beside it: CPU seconds per MB of the
   build's main process (reading, cleaning, cutting chunks, writing and checking shards) and
   of its workers (tokenizing, cutting sentences), against bare ``tokenizers``' processes
   (on a machine shared with other work the clock scatters, CPU per byte much less).
2. The same build against the ``datasets`` recipe: ``Dataset.from_text`` ->
   ``.map(BertTokenizerFast, batched=True, num_proc=N)`` -> ``save_to_disk`` with the
   same vocabulary, no special tokens, ids only (goal: ours >= 1.5x).
3. Bytes on disk per token of that build (shards: .bin + .idx), at the vocabulary size
   ``--vocab-size`` (default BERT's 30,522; goal <= 2.2). The vocabulary is trained
   with the build's trainer on up to two copies of the sample: the corpus is the
   sample repeated, and WordPiece merges depend only on relative counts once every
   pair passes the minimum frequency, so more copies change no entry. The bundled
   sample has fewer distinct subwords than 30,522; the actual size is reported.
4. Peak RSS of one build worker (goal < 2 GB per worker for a 1 GB corpus). A worker holds
   at most 2 chunks of ``CHUNK_CHARS`` characters, whatever the corpus size, so a smaller
   corpus measures the same peak; the corpus size is reported beside it. With
   ``--workers 1`` the build tokenizes in its own process and that process's peak (imports
   included) is reported.
5., 6. With ``--files N``: figures 1 and 2 again on the same corpus cut at line ends into about
   N files of log-uniform sizes (largest ~50x smallest; ~1.8-90 KB at 44 MB and 2,000 files):
   the layout where per-file costs show.

The default corpus is the bundled WikiText-2 sample (``data_tools/sample``) repeated to
``--corpus-mb`` MB (decimal), written to a temporary folder that is removed at the end.
Imports (``transformers``, ``datasets``, ``torch``) happen before each timer starts:
they cost the same whatever the corpus size. The load average before and after is
printed, as the figures depend on what else runs on the machine.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert_ds.data_tools.tokenizer import HF_FILES

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
SAMPLE_FILES = ("valid.txt", "test.txt")
BERT_VOCAB_SIZE = 30522
MB = 1e6


@dataclass
class Figure:
    name: str
    value: float
    shown: str  # value as printed, with its unit
    goal: str
    met: bool
    how: str  # the measurement behind it, one line

    def to_dict(self) -> dict:
        return {"name": self.name, "value": self.value, "shown": self.shown, "goal": self.goal, "met": self.met,
                "how": self.how}


# -- corpus and vocabulary -----------------------------------------------------------------

def make_corpus(path: Path, size_bytes: int) -> tuple[int, float]:
    """The sample repeated to at most size_bytes, cut at a line end; (bytes, copies)."""
    sample = b"".join((SAMPLE_DIR / name).read_bytes() for name in SAMPLE_FILES)
    written = 0
    with open(path, "wb") as f:
        while written < size_bytes:
            piece = sample[: size_bytes - written]
            if len(piece) < len(sample):
                piece = piece[: piece.rfind(b"\n") + 1]
                if not piece:
                    break
            f.write(piece)
            written += len(piece)
    return written, written / len(sample)


SIZE_SPREAD = 50  # many-files layout: the largest file is about 50x the smallest


def split_corpus(corpus: Path, folder: Path, files: int, seed: int = 0) -> list[Path]:
    """The corpus cut at line ends into about ``files`` files of log-uniform sizes whose
    mean is the corpus size / ``files`` (at 44 MB and 2,000 files: ~1.8 to ~88 KB)."""
    data = corpus.read_bytes()
    mean = len(data) / files
    smallest = mean * np.log(SIZE_SPREAD) / (SIZE_SPREAD - 1)  # the mean of a log-uniform [a, 50a] is 49a/ln 50
    sizes = smallest * SIZE_SPREAD ** np.random.default_rng(seed).random(4 * files + 16)
    folder.mkdir()
    paths, pos = [], 0
    for size in sizes:
        if pos >= len(data):
            break
        end = data.find(b"\n", pos + int(size) - 1)
        end = len(data) if end < 0 else end + 1
        paths.append(folder / f"part_{len(paths):05d}.txt")
        paths[-1].write_bytes(data[pos:end])
        pos = end
    if pos < len(data):  # more text than draws: the rest is one more file
        paths.append(folder / f"part_{len(paths):05d}.txt")
        paths[-1].write_bytes(data[pos:])
    return paths


def make_vocab(work: Path, corpus: Path, size: int) -> tuple[bytes, float, float]:
    """WordPiece vocab.txt trained on up to two copies of the sample; (vocab, MB trained on, seconds)."""
    from bert_ds.data_tools.text import iter_text
    from bert_ds.data_tools.tokenizer import train_vocab

    sample_bytes = sum((SAMPLE_DIR / name).stat().st_size for name in SAMPLE_FILES)
    text = work / "vocab_corpus.txt"
    with open(corpus, "rb") as src, open(text, "wb") as dst:
        dst.write(src.read(2 * sample_bytes))  # the corpus starts with whole copies
    t0 = time.perf_counter()
    vocab = train_vocab(lambda: iter_text([str(text)]), size, lowercase=True)
    seconds = time.perf_counter() - t0
    trained_on = text.stat().st_size / MB
    text.unlink()
    return vocab, trained_on, seconds


# -- a synthetic dataset of any size, for the loader's scale bench ---------------------------------

SYNTHETIC_SENTENCE = (8, 48)  # tokens per sentence, uniform, inclusive
SYNTHETIC_DOCUMENT = (5, 60)  # sentences per document, uniform, inclusive
# Documents long enough that a documents-layout piece of 8,192 tokens is often full (mean ~8.5k
# tokens, at most 28,800): ModernBERT's long-context phase draws such pieces.
LONG_DOCUMENT = (5, 600)
_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def synthetic_description(tokens: int, seed: int = 0, document: tuple[int, int] = SYNTHETIC_DOCUMENT) -> str:
    """What :func:`write_synthetic` records of a dataset in its manifest (``build.synthetic``): the
    same string for the same call, so a kept dataset is reused only for the one asked."""
    shape = "" if document == SYNTHETIC_DOCUMENT else f", documents of U[{document[0]}, {document[1]}] sentences"
    return f"{tokens} tokens, seed {seed}{shape}"


def write_synthetic(folder: Path, tokens: int, shard_tokens: int = 1 << 26, seed: int = 0,
                    document: tuple[int, int] = SYNTHETIC_DOCUMENT) -> dict[str, int]:
    """A dataset of about ``tokens`` random ids in BERT's vocabulary size, shaped like prose:
    sentences of U[8, 48] tokens, documents of U[``document``] sentences (U[5, 60] by default;
    :data:`LONG_DOCUMENT` for pieces of 8,192 tokens). Returns its totals."""
    from bert_ds.data_tools.manifest import Manifest, tokenizer_fingerprint
    from bert_ds.data_tools.shard_format import ShardWriter, token_dtype

    folder.mkdir(parents=True, exist_ok=True)
    words = list(_SPECIALS) + [f"w{i}" for i in range(BERT_VOCAB_SIZE - len(_SPECIALS))]
    (folder / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    rng = np.random.default_rng(seed)
    shards, written = [], 0
    while written < tokens:
        name = f"shard-{len(shards):05d}"
        with ShardWriter(folder / name, BERT_VOCAB_SIZE) as writer:
            written += _synthetic_shard(writer, rng, min(shard_tokens, tokens - written), document)
            shards.append(writer.close())
    manifest = Manifest(
        vocab_size=BERT_VOCAB_SIZE, token_dtype=token_dtype(BERT_VOCAB_SIZE).name, lowercase=True,
        special_tokens={k: i for i, k in enumerate(("pad", "unk", "cls", "sep", "mask"))},
        tokenizer_fingerprint=tokenizer_fingerprint(folder / "vocab.txt"), shards=shards,
        totals={"docs": sum(s.num_docs for s in shards), "sentences": sum(s.num_sentences for s in shards),
                "tokens": written},
        build={"synthetic": synthetic_description(tokens, seed, document)})
    manifest.save(folder)
    return manifest.totals


def _synthetic_shard(writer, rng: np.random.Generator, budget: int, document: tuple[int, int]) -> int:
    """Whole documents of random ids until ``budget`` tokens are reached (the last may pass it)."""
    written = 0
    per_document = 800 * sum(document) / sum(SYNTHETIC_DOCUMENT)  # tokens, a little under the mean (910 by default)
    while written < budget:
        # a batch of documents per round of draws: about the tokens left (at most 16M), not many more
        docs = max(1, int(min(budget - written, 1 << 24) // per_document))
        sentences = rng.integers(document[0], document[1] + 1, size=docs)
        lengths = rng.integers(SYNTHETIC_SENTENCE[0], SYNTHETIC_SENTENCE[1] + 1, size=int(sentences.sum()))
        ids = rng.integers(len(_SPECIALS), BERT_VOCAB_SIZE, size=int(lengths.sum()), dtype=np.uint16)
        sent_end = np.cumsum(sentences).tolist()
        tok_end = np.concatenate([[0], np.cumsum(lengths)])[sent_end].tolist()
        lo_s = lo_t = 0
        for hi_s, hi_t in zip(sent_end, tok_end, strict=True):
            writer.add_sentences(ids[lo_t:hi_t], lengths[lo_s:hi_s])
            writer.end_document()
            written += hi_t - lo_t
            lo_s, lo_t = hi_s, hi_t
            if written >= budget:
                break
    return written


# -- child processes: each measurement runs in a fresh process ---------------------------------

def _in_child(target, *args) -> dict:
    """Run target(conn, *args) in a spawned, non-daemonic process (it starts pools of its own)."""
    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(send, *args))
    proc.start()
    send.close()
    try:
        result = recv.recv()
    except EOFError:
        result = {"error": "the process died without a result"}
    proc.join()
    if "error" in result:
        raise RuntimeError(f"bench: {target.__name__} failed: {result['error']}")
    return result


def _report(conn, fn, *args) -> None:
    try:
        conn.send(fn(*args))
    except BaseException as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise


def _build_child(conn, inputs: list[str], output: str, vocab: str, workers: int) -> None:
    _report(conn, _run_build, inputs, output, vocab, workers)


def _run_build(inputs: list[str], output: str, vocab: str, workers: int) -> dict:
    import transformers  # noqa: F401 -- the build's tokenizer step imports it: a fixed cost, not timed

    from bert_ds.data_tools.build import BuildOptions, build

    opts = BuildOptions(inputs=inputs, output=output, vocab=vocab, workers=workers, split_sentences=True,
                        progress=False)
    t0, cpu0, main0 = time.perf_counter(), _cpu_seconds(), _cpu_seconds(children=False)
    result = build(opts)
    seconds, cpu, main_cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0, _cpu_seconds(children=False) - main0
    # ru_maxrss is in KiB on Linux. RUSAGE_CHILDREN: the largest child waited for,
    # i.e. the pool's workers, which the build joins before it returns.
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    workers_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    m = result.manifest
    return {
        "seconds": seconds, "cpu_seconds": cpu, "main_cpu_seconds": main_cpu, "tokens": m.totals["tokens"],
        "input_bytes": m.stats["input_bytes"],
        "bytes_on_disk": result.bytes_on_disk, "vocab_size": m.vocab_size, "token_dtype": m.token_dtype,
        "documents": m.totals["docs"], "sentences": m.totals["sentences"],
        "worker_peak_rss": workers_peak if workers > 1 else own, "main_peak_rss": own,
    }


def _cpu_seconds(children: bool = True) -> float:
    """User + system CPU of this process and (``children``) of the children it has waited for (a
    build's workers, a pool's processes): on a shared machine a steadier measure than the clock."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    total = own.ru_utime + own.ru_stime
    if children:
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += kids.ru_utime + kids.ru_stime
    return total


_bare_encode = None


def _bare_init(tokenizer_json: str) -> None:
    global _bare_encode
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process, as the build's workers
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    _bare_encode = getattr(tok, "encode_batch_fast", tok.encode_batch)


def _bare_slice(path: str, start: int, end: int, batch_chars: int) -> int:
    """Tokens of the lines whose first byte lies in [start, end)."""
    tokens = 0
    batch: list[str] = []
    size = 0
    with open(path, "rb", buffering=1 << 20) as f:
        pos = start
        if start:
            f.seek(start - 1)
            pos = start - 1 + len(f.readline())  # the line holding byte start-1 is the previous slice's
        while pos < end:
            line = f.readline()
            if not line:
                break
            pos += len(line)
            s = line.decode("utf-8", errors="replace").strip()
            if s:
                batch.append(s)
                size += len(s)
                if size >= batch_chars:
                    tokens += sum(map(len, _bare_encode(batch, add_special_tokens=False)))
                    batch, size = [], 0
    if batch:
        tokens += sum(map(len, _bare_encode(batch, add_special_tokens=False)))
    return tokens


def _bare_files(tasks: list[tuple[str, int, int]], batch_chars: int) -> int:
    """Tokens of the lines of each (path, start, end) slice, one after the other."""
    return sum(_bare_slice(path, start, end, batch_chars) for path, start, end in tasks)


def _bare_tasks(inputs: list[str], workers: int) -> list[list[tuple[str, int, int]]]:
    """Each process's (path, start, end) slices: the inputs back to back cut into ``workers``
    runs of equal bytes (a line belongs to the slice that holds its first byte)."""
    sizes = [os.path.getsize(p) for p in inputs]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    bounds = [int(starts[-1]) * k // workers for k in range(workers + 1)]
    tasks: list[list[tuple[str, int, int]]] = [[] for _ in range(workers)]
    for k in range(workers):
        for i, path in enumerate(inputs):
            lo, hi = max(bounds[k], starts[i]), min(bounds[k + 1], starts[i + 1])
            if lo < hi:
                tasks[k].append((path, int(lo - starts[i]), int(hi - starts[i])))
    return tasks


def run_bare(inputs: list[str], tokenizer_json: str, workers: int) -> dict:
    from bert_ds.data_tools.build import CHUNK_CHARS

    tasks = _bare_tasks(inputs, workers)
    ctx = multiprocessing.get_context("spawn")
    t0, cpu0 = time.perf_counter(), _cpu_seconds()
    pool = ctx.Pool(workers, initializer=_bare_init, initargs=(tokenizer_json,))
    counts = pool.starmap(_bare_files, [(t, CHUNK_CHARS) for t in tasks])
    pool.close()
    pool.join()  # waited for: their CPU time is counted
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds() - cpu0
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": sum(counts),
            "input_bytes": sum(os.path.getsize(p) for p in inputs)}


def _datasets_child(conn, inputs: list[str], tokenizer_dir: str, work: str, workers: int) -> None:
    _report(conn, _run_datasets, inputs, tokenizer_dir, work, workers)


def _run_datasets(inputs: list[str], tokenizer_dir: str, work: str, workers: int) -> dict:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # num_proc processes of one thread, as ours
    import datasets
    from transformers import BertTokenizerFast

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    tok = BertTokenizerFast.from_pretrained(tokenizer_dir)

    def encode(batch):
        return tok(batch["text"], add_special_tokens=False, return_attention_mask=False,
                   return_token_type_ids=False)

    t0 = time.perf_counter()
    ds = datasets.Dataset.from_text(inputs, cache_dir=os.path.join(work, "cache"))
    ids = ds.map(encode, batched=True, num_proc=workers if workers > 1 else None, remove_columns=["text"])
    ids.save_to_disk(os.path.join(work, "saved"))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "input_bytes": sum(os.path.getsize(p) for p in inputs), "rows": len(ids)}


# -- the run ---------------------------------------------------------------------------------------

PIPELINES = ("build", "bare_tokenizers", "datasets")


def run(corpus_mb: float, workers: int, vocab_size: int, files: int | None = None, rounds: int = 5,
        log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> dict:
    """All measurements; the dict that --json writes. Each round runs the three pipelines on each
    layout, one after the other, in an order that turns each round (drift in the machine's load
    then falls on every pipeline alike); a figure is the median of its rounds' ratios."""
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="data_tools_bench_") as tmp:
        work = Path(tmp)
        corpus = work / "corpus.txt"
        corpus_bytes, copies = make_corpus(corpus, int(corpus_mb * MB))
        log(f"bench: corpus {corpus_bytes / MB:.1f} MB ({copies:.2f} copies of the sample) in {work}")

        vocab, vocab_mb, vocab_s = make_vocab(work, corpus, vocab_size)
        (work / "vocab.txt").write_bytes(vocab)
        log(f"bench: vocabulary trained in {vocab_s:.1f} s")
        layouts = {"one_file": [str(corpus)]}
        if files:
            layouts["many_files"] = [str(p) for p in split_corpus(corpus, work / "files", files)]
        tokenizer = work / "tokenizer"  # the build's own tokenizer folder, for the other pipelines
        measured = {name: {p: [] for p in PIPELINES} for name in layouts}
        for k in range(rounds):
            for name, inputs in layouts.items():
                for pipeline in PIPELINES[k % 3:] + PIPELINES[: k % 3]:
                    log(f"bench: round {k + 1}/{rounds}, {name.replace('_', ' ')} ({len(inputs):,}): {pipeline}")
                    measured[name][pipeline].append(_measure(pipeline, inputs, work, tokenizer, workers))
        sizes = [os.path.getsize(p) for p in layouts.get("many_files", [])]
    return {
        "corpus": {"source": f"{SAMPLE_DIR} ({', '.join(SAMPLE_FILES)}) repeated", "bytes": corpus_bytes,
                   "copies": round(copies, 3)},
        "workers": workers,
        "rounds": rounds,
        "cpus": len(os.sched_getaffinity(0)),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "vocab": {"requested": vocab_size, "size": measured["one_file"]["build"][0]["vocab_size"],
                  "token_dtype": measured["one_file"]["build"][0]["token_dtype"],
                  "trained_on_mb": round(vocab_mb, 3), "train_seconds": vocab_s},
        **({"files": {"count": len(sizes), "min_bytes": min(sizes), "max_bytes": max(sizes)}} if sizes else {}),
        "layouts": measured,
    }


def _measure(pipeline: str, inputs: list[str], work: Path, tokenizer: Path, workers: int) -> dict:
    """One run of one pipeline on ``inputs``, in a fresh folder removed afterwards."""
    out = work / "out"
    try:
        if pipeline == "build":
            result = _in_child(_build_child, inputs, str(out), str(work / "vocab.txt"), workers)
            if not tokenizer.exists():
                tokenizer.mkdir()
                for name in HF_FILES:
                    shutil.copy(out / name, tokenizer / name)
            return result
        if pipeline == "bare_tokenizers":
            return run_bare(inputs, (tokenizer / "tokenizer.json").read_text(encoding="utf-8"), workers)
        return _in_child(_datasets_child, inputs, str(tokenizer), str(out), workers)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _mbs(run: dict) -> float:
    return run["input_bytes"] / run["seconds"] / MB


def _ratios(m: dict, other: str) -> list[float]:
    """Per round: build MB/s over ``other``'s MB/s in the same round."""
    return [_mbs(b) / _mbs(o) for b, o in zip(m["build"], m[other], strict=True)]


def _spread(values: list[float], fmt: str) -> str:
    return f"median of {len(values)} rounds; {format(min(values), fmt)}-{format(max(values), fmt)}"


def figures(r: dict) -> list[Figure]:
    one = r["layouts"]["one_file"]
    b = one["build"][0]
    bpt = b["bytes_on_disk"] / b["tokens"]
    rss = max(x["worker_peak_rss"] for x in one["build"])
    corpus = r["corpus"]["bytes"] / MB
    vocab = r["vocab"]
    vocab_note = "" if vocab["size"] == vocab["requested"] else \
        f" (asked {vocab['requested']:,}: the corpus has no more merges)"
    figs = _speed_figures(one, "", r["workers"]) + [
        Figure("bytes on disk per token", bpt, f"{bpt:.3f}", "<= 2.2", bpt <= 2.2,
               f"{b['bytes_on_disk']:,} bytes for {b['tokens']:,} tokens, vocab {vocab['size']:,}{vocab_note}, "
               f"{b['token_dtype']}"),
        Figure("build worker peak RSS", rss / MB, f"{rss / MB:,.0f} MB", "< 2,000 MB", rss < 2e9,
               f"on a {corpus:.1f} MB corpus (goal stated for 1 GB; a worker's memory does not grow with it)"
               + ("; --workers 1: the build process itself" if r["workers"] == 1 else
                  f"; build main process {b['main_peak_rss'] / MB:,.0f} MB")),
    ]
    if "many_files" in r["layouts"]:
        f = r["files"]
        figs += _speed_figures(r["layouts"]["many_files"], f", {f['count']:,} files", r["workers"],
                               f"{f['count']:,} files of {f['min_bytes']:,}-{f['max_bytes']:,} bytes: ")
    return figs


def _speed_figures(m: dict, suffix: str, workers: int, prefix: str = "") -> list[Figure]:
    """build / bare tokenizers and build / datasets on one layout, each the median over rounds."""
    bare, hf = _ratios(m, "bare_tokenizers"), _ratios(m, "datasets")
    ratio, speedup = float(np.median(bare)), float(np.median(hf))
    med = {p: float(np.median([_mbs(x) for x in m[p]])) for p in PIPELINES}
    return [
        Figure(f"build / bare tokenizers{suffix}", ratio, f"{ratio:.2f}", ">= 0.90", ratio >= 0.90,
               f"{prefix}{_spread(bare, '.2f')}: build {med['build']:.2f} MB/s, bare tokenizers "
               f"{med['bare_tokenizers']:.2f} MB/s (medians); {workers} process(es) each; {_cpu_note(m)}"),
        Figure(f"build / datasets map+save_to_disk{suffix}", speedup, f"{speedup:.2f}x", ">= 1.5x", speedup >= 1.5,
               f"{prefix}{_spread(hf, '.2f')}: datasets {med['datasets']:.2f} MB/s (num_proc {workers}) vs build "
               f"{med['build']:.2f} MB/s (medians)"),
    ]


def _cpu_note(m: dict) -> str:
    """Where the build's CPU goes beside bare tokenizers', per MB of input (medians over rounds):
    its main process (reading, cleaning, cutting chunks, writing and checking shards) and its
    workers (tokenizing, cutting sentences): what the ratio loses when the cores are busy."""
    def per_mb(runs: list[dict], key: str) -> float:
        return float(np.median([x[key] / (x["input_bytes"] / MB) for x in runs]))

    main, total, bare = per_mb(m["build"], "main_cpu_seconds"), per_mb(m["build"], "cpu_seconds"), \
        per_mb(m["bare_tokenizers"], "cpu_seconds")
    return (f"CPU-s per MB: build {total:.3f} = main process {main:.3f} + workers {total - main:.3f}; "
            f"bare tokenizers {bare:.3f} (bare/build {bare / total:.2f})")


def format_report(r: dict, figs: list[Figure]) -> str:
    c = r["corpus"]
    lines = [
        f"corpus: {c['bytes'] / MB:.1f} MB = {c['copies']:g} copies of the bundled WikiText-2 sample; "
        f"{r['workers']} worker(s) on {r['cpus']} CPU(s); {r['rounds']} round(s); load average "
        f"{r['load_average_before'][0]:.2f} "
        f"before, {r['load_average_after'][0]:.2f} after",
        f"vocabulary: {r['vocab']['size']:,} entries (asked {r['vocab']['requested']:,}), trained on "
        f"{r['vocab']['trained_on_mb']:.1f} MB in {r['vocab']['train_seconds']:.1f} s",
        "",
    ]
    width = max(len(f.name) for f in figs) + 4
    lines.append(f"{'figure':<{width}}{'measured':>14}  {'goal':<12}met")
    for i, f in enumerate(figs, 1):
        lines.append(f"{f'{i}. {f.name}':<{width}}{f.shown:>14}  {f.goal:<12}{'yes' if f.met else 'NO'}")
    lines.append("")
    lines += [f"{i}. {f.how}" for i, f in enumerate(figs, 1)]
    return "\n".join(lines)


def main(corpus_mb: float, workers: int, vocab_size: int, json_path: str | None, files: int | None = None,
         rounds: int = 5) -> int:
    r = run(corpus_mb, workers, vocab_size, files, rounds)
    figs = figures(r)
    r["figures"] = [f.to_dict() for f in figs]
    print(format_report(r, figs))
    if json_path:
        Path(json_path).write_text(json.dumps(r, indent=2) + "\n", encoding="utf-8")
    return 0
