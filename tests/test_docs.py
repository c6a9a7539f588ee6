"""The documentation describes the software as it is.

- Every command in a ```bash block of README.md and docs/*.md names a module, script or
  run.sh mode that answers --help, and every --flag it uses is in that help: a renamed flag
  or module fails here. A planted wrong flag is caught.
- The blocks marked ``<!-- docs-test: run -->`` run end to end on tiny data.
- Every relative link resolves, anchors included.
- docs/configuration.md is what ``bert_ds.tools.config_reference`` generates from the code.
- The README stays a front page (at most ~250 lines), and no page tells history.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bert_ds.tools import config_reference
from bert_ds.train import cli as train_cli
from tests import docs_commands as docs
from tests.conftest import REPO, SAMPLE, cli_env, end, make_bpe_tokenizer, spawn

README_MAX_LINES = 260  # the "at most ~250"
# Sentences about earlier versions belong in CHANGELOG.md, not in a page about the software.
HISTORY = re.compile(r"\b(used to|no longer|earlier version|previous commit|since then|predates?|"
                     r"before the change|it was \+|were measured before|this session)\b", re.IGNORECASE)


@functools.cache
def help_text(help_argv: tuple[str, ...]) -> tuple[int, str]:
    """(exit status, output) of ``--help`` for a command's target; never run for one that does
    not read its arguments (it would run, not answer)."""
    if not docs.parses_its_arguments(help_argv):
        return 1, "it does not read its command line (no ArgumentParser, no --help), so --help would run it"
    cmd = [str(REPO / help_argv[0])] if help_argv[0].endswith(".sh") else [sys.executable, *help_argv]
    proc = subprocess.run(cmd + ["--help"], capture_output=True, text=True, cwd=REPO, env=cli_env(), timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def problems(found: list[tuple[docs.Command, docs.Target]]) -> list[str]:
    """Why each documented command would fail: an unknown run.sh mode, a module or script
    without --help, a flag its help does not list."""
    out = []
    modes = docs.run_sh_modes()
    targets = {t.help_argv for _, t in found if t.help_argv != ("./run.sh",)}
    with ThreadPoolExecutor(4) as pool:  # each --help imports torch: a few seconds apiece
        list(pool.map(help_text, sorted(targets)))
    for command, t in found:
        if t.run_sh_mode is not None and t.run_sh_mode not in modes:
            out.append(f"{command.where}: ./run.sh has no mode {t.run_sh_mode!r}")
            continue
        if t.help_argv == ("./run.sh",):
            continue
        status, text = help_text(t.help_argv)
        if status != 0 or "usage" not in text.lower():
            out.append(f"{command.where}: `{' '.join(t.help_argv)} --help` fails (exit {status}): {text[-300:]}")
            continue
        out += [f"{command.where}: {' '.join(t.help_argv)} has no flag {f}" for f in docs.missing_flags(t.flags, text)]
    return out


def test_every_documented_command_answers_help_and_takes_its_flags():
    found = docs.documented_commands()
    assert len(found) >= 40, f"only {len(found)} commands found in the docs: is the extraction broken?"
    kinds = {t.help_argv for _, t in found}
    assert {("-m", "bert_ds.train"), ("-m", "bert_ds.data_tools", "build"), ("-m", "bert_ds.checkpoint.export"),
            ("-m", "bert_ds.tools.bench"), ("-m", "bert_ds.eval", "glue")} <= kinds
    failures = problems(found)
    assert not failures, "\n".join(failures)


def _planted(text: str, old: str, new: str) -> list[str]:
    """The problems of README.md with ``old`` replaced once, in a command, by ``new``."""
    assert old in text
    path = Path("README.md")
    planted = []
    for block in docs.blocks(path, text.replace(old, new, 1)):
        for command in docs.commands(block):
            t = docs.target(command.argv)
            if t is not None and any(new.split()[-1] in a for a in command.argv):
                planted.append((command, t))
    assert planted, f"{new!r} did not land in a command"
    return problems(planted)


# A documented command that runs a phase of the shipped recipe (its steps and global batch)
# quotes the recipe's other figures: the docs tests check flags exist, this checks the numbers.
RECIPE = REPO / "bert_ds" / "recipes" / "bert_base_two_phase.json"
PHASE_FLAGS = {"--steps": ("steps",), "--global-batch-size": ("global_batch_size",),
               "--micro-batch-size": ("micro_batch_size",), "--lr": ("optim", "lr"),
               "--warmup-steps": ("optim", "warmup_steps"), "--seq-len": ("data", "max_seq_length")}


def _flag_values(argv: list[str]) -> dict[str, str]:
    values = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            values[name] = value or (argv[i + 1] if i + 1 < len(argv) else "")
    return values


def recipe_figures(found) -> tuple[int, list[str]]:
    """(commands quoting a phase, the figures they quote wrong)."""
    phases = json.loads(RECIPE.read_text())["phases"]
    quoting, wrong = 0, []
    for command, _ in found:
        flags = _flag_values(command.argv)
        for phase in phases:
            if flags.get("--steps") != str(phase["steps"]) or flags.get("--global-batch-size") != str(
                    phase["global_batch_size"]):
                continue
            quoting += 1
            for flag, keys in PHASE_FLAGS.items():
                want = functools.reduce(lambda d, k: d[k], keys, phase)
                if flag in flags and float(flags[flag]) != float(want):
                    wrong.append(f"{command.where}: {flag} {flags[flag]}, but {phase['name']} of {RECIPE.name} "
                                 f"holds {want}")
    return quoting, wrong


def test_commands_quoting_the_recipe_quote_its_figures():
    quoting, wrong = recipe_figures(docs.documented_commands())
    assert quoting >= 4, f"only {quoting} documented commands run a phase of {RECIPE.name}: is the match broken?"
    assert not wrong, "\n".join(wrong)
    path = REPO / "docs" / "multi-node.md"
    planted = path.read_text(encoding="utf-8").replace("--micro-batch-size 512", "--micro-batch-size 256", 1)
    found = [(c, t) for b in docs.blocks(path, planted) for c in docs.commands(b) if (t := docs.target(c.argv))]
    assert any("--micro-batch-size 256, but phase1" in w for w in recipe_figures(found)[1])


def test_a_planted_wrong_flag_module_or_mode_is_caught():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    wrong_flag = _planted(text, "--output runs/", "--outptu runs/")
    assert any("has no flag --outptu" in p for p in wrong_flag), wrong_flag
    wrong_module = _planted(text, "-m bert_ds.data_tools build", "-m bert_ds.data_tool build")
    assert any("--help` fails" in p for p in wrong_module), wrong_module


def test_a_wrong_run_sh_mode_and_an_unreadable_command_are_caught():
    block = docs.Block(Path("x.md"), 1, "NGPU=8 ./run.sh pretrian --steps 3\ntorchrun --nproc-per-node 8 train.py\n",
                       runnable=False)
    first, second = docs.commands(block)
    assert problems([(first, docs.target(first.argv))]) == ["x.md:2: ./run.sh has no mode 'pretrian'"]
    with pytest.raises(ValueError, match="torchrun without -m"):
        docs.target(second.argv)


def test_commands_are_read_as_a_shell_reads_them():
    block = docs.Block(Path("x.md"), 1, "# a comment\nOMP_NUM_THREADS=1 python -m bert_ds.train --data d \\\n"
                       "    --steps 3  # trailing\ncat > f <<'EOF'\npython -m nothing --x\nEOF\n"
                       "srun -n 4 .venv/bin/python -m bert_ds.data_tools build --part 1/4 && python -m x.y\n",
                       runnable=False)
    got = [(c.where, docs.target(c.argv)) for c in docs.commands(block)]
    assert [(w, t.help_argv, t.flags) for w, t in got] == [
        ("x.md:3", ("-m", "bert_ds.train"), ["--data", "--steps"]),
        ("x.md:8", ("-m", "bert_ds.data_tools", "build"), ["--part"]),
        ("x.md:8", ("-m", "x.y"), []),
    ]


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for path in docs.DOC_FILES + [REPO / "CHANGELOG.md"]:
        for line, link in docs.links(path):
            target, _, anchor = link.partition("#")
            resolved = (path.parent / target).resolve() if target else path
            if not resolved.exists():
                broken.append(f"{path.name}:{line}: {link} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in docs.anchors(resolved):
                broken.append(f"{path.name}:{line}: {link} (no heading #{anchor} in {resolved.name})")
    assert not broken, "\n".join(broken)


def test_a_broken_link_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title here\n\n[ok](#title-here) [bad](#nowhere) [file](missing.md)\n")
    assert docs.anchors(page) == {"title-here"}
    assert [link for _, link in docs.links(page)] == ["#title-here", "#nowhere", "missing.md"]


def test_github_heading_anchors():
    assert docs.slug("Partitioned builds") == "partitioned-builds"
    assert docs.slug("Two commands: `./run.sh` and `./run.sh test`") == "two-commands-runsh-and-runsh-test"
    assert docs.slug("At corpus scale: 32.8B and 2T tokens") == "at-corpus-scale-328b-and-2t-tokens"


def test_the_configuration_reference_is_generated_from_the_code():
    page = REPO / "docs" / "configuration.md"
    assert page.read_text(encoding="utf-8") == config_reference.page(), (
        "docs/configuration.md differs from the code: run python -m bert_ds.tools.config_reference --write")


def test_the_configuration_reference_explains_every_field_and_names_real_flags():
    parser_flags = {o for a in train_cli.build_parser()._actions for o in a.option_strings}
    for flag, fields in config_reference.flag_fields().items():
        assert flag in parser_flags and fields, flag
        for field in fields:
            section, _, name = field.rpartition(".")
            # a section's fields: of every class it may hold (model: BERT's ModelConfig or ModernBertConfig)
            assert name in {f.name for cls, cls_section in config_reference.SECTIONS if cls_section == section
                            for f in dataclasses.fields(cls)}, field
    for cls, _ in config_reference.SECTIONS:
        unexplained = [name for name, text in config_reference.field_comments(cls).items() if not text]
        assert not unexplained, f"{cls.__name__} fields without a comment: {unexplained}"


def test_the_readme_is_a_front_page_and_no_page_tells_history():
    readme = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines"
    told = [f"{p.name}:{n}: {line.strip()}" for p in docs.DOC_FILES
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if HISTORY.search(line)]
    assert not told, "history belongs in CHANGELOG.md:\n" + "\n".join(told)


def test_the_docs_build_as_a_site_with_strict_checks(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra; ./run.sh docs builds the site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").is_file()


# --- runnable blocks ------------------------------------------------------------------------------------

# Appended to a runnable block's commands, so that a recipe written for a real corpus takes seconds
# here (argparse keeps the last value of a repeated flag).
TINY = {
    ("-m", "bert_ds.train"): ["--steps", "2", "--global-batch-size", "4", "--micro-batch-size", "4", "--seq-len", "64",
                              "--warmup-steps", "1", "--ds-config", "zero0_fp32.json", "--num-workers", "0",
                              "--no-progress", "--no-tensorboard", "--val-samples", "8"],
    ("-m", "bert_ds.data_tools", "build"): ["--workers", "1"],
    ("-m", "bert_ds.tools.bench"): ["--seq-len", "64", "--batch-size", "8", "--vocab-size", "2048", "--no-probes"],
    ("-m", "bert_ds.eval", "squad"): ["--seeds", "1", "--no-progress"],  # the recipe as it is: the data is tiny
    ("-m", "bert_ds.eval", "ner"): ["--seeds", "1", "--no-progress"],
    ("-m", "bert_ds.eval", "retrieval"): ["--seeds", "1", "--no-progress"],
}


def _workspace(root: Path) -> Path:
    """What the recipes expect to find: text in domain/ and corpus/, a Hugging Face BERT in
    bert-base-uncased/ and an export of one in runs/domain/hf/, a ModernBERT tokenizer in
    ModernBERT-base/, the phase plans in bert_ds/recipes/, made-up SQuAD v1.1 in squad/,
    CoNLL-2003 in conll/ and a BEIR-format task in beir/ (all made here or shipped with the
    tests: nothing is downloaded)."""
    import torch
    import transformers

    from bert_ds.data_tools.tokenizer import Normalization, install_tokenizer, train_vocab, vocab_entries
    from tests.bert_ds.test_ner import learnable_conll
    from tests.bert_ds.test_squad import learnable_squad

    lines = (SAMPLE / "valid.txt").read_text(encoding="utf-8").splitlines(keepends=True)[:2400]
    for folder in ("domain", "corpus"):
        (root / folder).mkdir()
        for i in range(2):
            (root / folder / f"part{i}.txt").write_text("".join(lines[i * 1200:(i + 1) * 1200]), encoding="utf-8")
    vocab = train_vocab(lambda: lines, 512, lowercase=True)
    hf = root / "bert-base-uncased"
    hf.mkdir()
    install_tokenizer(hf, vocab, Normalization(lowercase=True))
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(vocab_entries(vocab)), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    transformers.BertForPreTraining(config).save_pretrained(hf)
    shutil.copytree(hf, root / "runs" / "domain" / "hf")
    learnable_squad(root / "squad", sizes=(64, 32))
    learnable_conll(root / "conll")
    shutil.copytree(REPO / "tests" / "assets" / "retrieval" / "tiny-beir", root / "beir")
    # A ModernBERT tokenizer's stand-in (a byte-level BPE) and the recipes the README names
    make_bpe_tokenizer(root / "ModernBERT-base", lines, 2048)
    shutil.copytree(REPO / "bert_ds" / "recipes", root / "bert_ds" / "recipes")
    return root


def _runnable():
    """Each marked recipe once: the same commands marked in two pages run once, named by both."""
    same: dict[tuple, list[docs.Block]] = {}
    for block in (b for p in docs.DOC_FILES for b in docs.blocks(p) if b.runnable):
        same.setdefault(tuple(tuple(c.argv) for c in docs.commands(block)), []).append(block)
    return [pytest.param(blocks[0], id="+".join(f"{b.path.name}:{b.line}" for b in blocks)) for blocks in same.values()]


@pytest.fixture(scope="session")
def workspace(tmp_path_factory) -> Path:
    """One :func:`_workspace` per test process (a vocabulary and two models: seconds), copied
    for each recipe."""
    return _workspace(tmp_path_factory.mktemp("docs-workspace"))


@pytest.mark.parametrize("block", _runnable())
def test_a_marked_recipe_runs_end_to_end_on_tiny_data(block, workspace, tmp_path):
    root = tmp_path / "workspace"
    shutil.copytree(workspace, root)
    for command in docs.commands(block):
        argv = command.argv
        t = docs.target(argv)
        if argv[0] in docs.PYTHONS:
            argv = [sys.executable, *argv[1:]]
        elif argv[0] in docs.SCRIPTS:
            argv = [str(Path(sys.executable).parent / argv[0]), *argv[1:]]
        argv = [m for a in argv for m in (sorted(glob.glob(a, root_dir=root)) if set(a) & set("*?[") else [a]) or [a]]
        argv += TINY.get(t.help_argv, []) if t else []
        child = spawn(argv, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root)
        try:
            out, _ = child.communicate(timeout=600)
        finally:
            end(child)
        assert child.returncode == 0, f"{command.where}: {' '.join(command.argv)} exited {child.returncode}\n{out[-4000:]}"
        for shown in (s for s in _shown() if s.argv == command.argv):
            missing = docs.unshown(out, shown.text)
            assert not missing, f"{shown.where}: lines {command.where} does not print:\n" + "\n".join(missing) + f"\n{out}"


@functools.cache
def _shown() -> list[docs.Shown]:
    return [shown for p in docs.DOC_FILES for shown in docs.shown_outputs(p)]


def test_some_recipe_is_marked_to_run():
    assert len(_runnable()) >= 2


def test_every_shown_output_is_of_a_command_a_marked_recipe_runs():
    ran = [c.argv for p in docs.DOC_FILES for b in docs.blocks(p) if b.runnable for c in docs.commands(b)]
    shown = _shown()
    assert shown and all(s.argv in ran for s in shown), [s.where for s in shown if s.argv not in ran]


def test_a_shown_output_may_differ_in_figures_and_paths_but_not_in_lines():
    printed = ("{'train_runtime': '0.2'}\nsquad seed 1: f1 18.17 (2 steps, 7 s)\n# results: /tmp/x/hf\n\n"
               "Recipe (lr 5e-05, 3 epochs); seeds [1]\n| f1 | 18.17 | 18.17-18.17 |\n")
    shown = ("squad seed 1: f1 81.50 (120 steps, 93 s)\nsquad seed 2: f1 80.90 (120 steps, 92 s)\n"
             "# results: /home/me/runs/hf\nRecipe (lr 5e-05, 3 epochs); seeds [1, 2, 3]\n| f1 | 81.20 | 80.90-81.50 |")
    assert docs.unshown(printed, shown) == []
    assert docs.unshown(printed, shown.replace("| f1 |", "| exact |")) == ["| exact | N | N-N |"]
    assert docs.unshown(printed, shown.replace("epochs", "epoch")) == ["Recipe (lr N, N epoch); seeds [N]"]
    swapped = "| f1 | 1.0 | 1.0-1.0 |\nsquad seed 1: f1 1.0 (1 steps, 1 s)"
    assert docs.unshown(printed, swapped) == ["squad seed N: f1 N (N steps, N s)"]  # out of order
    assert docs.unshown("# SQuAD v1.1 dev results: /a/b", "# SQuAD v2.0 dev results: /c") == [
        "# SQuAD v2.0 dev results: PATH"]  # a version is a name, not a figure
    with pytest.raises(ValueError, match="must come between"):
        docs.shown_outputs(Path("x.md"), f"text\n{docs.OUTPUT_MARK}\n```text\nout\n```\n")
