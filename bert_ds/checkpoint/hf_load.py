"""Loading a model with transformers without its chatter on the terminal."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers' load report and progress bar off inside: the report lists the pretraining
    heads a task model drops and the layer it adds, at every load, which is the point of such a
    load, and the bar is a line of noise on a small model; errors still show."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.utils.logging.enable_progress_bar()


def load_quietly(model_class, folder: Path, **kwargs):
    """``model_class.from_pretrained(folder, **kwargs)`` under :func:`quiet_loading`
    (``output_loading_info=True`` still returns the report)."""
    with quiet_loading():
        return model_class.from_pretrained(folder, **kwargs)
