"""Fused kernels for BERT and their plain-PyTorch references.

Each op lives in ``kernels/<op>.py`` as ``<op>_ref()`` (the reference, plain
PyTorch: the definition tests compare against), ``<op>_native()`` (the fastest
PyTorch-native op for the inputs), ``<op>_fused()`` over the autograd Function of the
fused CUDA kernels, and ``<op>(..., backend=...)`` (the public op, which runs one of
them). The backend is resolved once per model with ``resolve_backend`` from a
``kernels: auto | cuda | torch`` setting and the model's shapes; ``auto`` races per op the
correct candidates on the device at those shapes (the fused kernel, the native op, the
reference under ``torch.compile``, apex's LayerNorm, torch's ``varlen_attn`` and SDPA's
backends for attention: ``speed.py``) and resolves to an :class:`OpPlan` naming the winners,
which the model hands to every op call.

- ``csrc/<op>.cu``: torch-free CUDA with ``extern "C"`` launchers (``csrc/launchers.h``);
  ``csrc/bindings.cpp``: the torch module ``bert_ds_kernels`` over them.
- ``_build.py``: the one loader (in-process -> prebuilt -> JIT build -> None with the
  reason) and the per-device record of the verdicts.
- ``ops.py``: the public face: the ops and :func:`resolve_backend`, what the model, the
  optimizer and user code import (``from bert_ds.kernels.ops import layer_norm``).
- ``dispatch.py``: per op call, the implementation the resolved backend names; :class:`OpPlan`.
- ``choice.py``: :func:`resolve_backend` and the per-device verdicts it rests on: self-check
  (``selfcheck.py``) and speed (``speed.py``).
- ``compiled.py``: an op's reference under ``torch.compile``, one of the candidates.
- ``python -m bert_ds.kernels.build``: build, self-check and time ahead of time.
- ``python -m bert_ds.kernels.compile_check``: every ``.cu`` with nvcc for sm_80 and sm_90, and
  the binding with the host compiler against torch's headers (CI, no GPU needed);
  ``--with-torch``: the real extension build against the CUDA build of torch.
- ``python -m bert_ds.kernels.inspect``: registers, spills, shared memory, CTAs per SM and the
  tensor-core / cp.async instruction counts of every kernel, from ptxas and the PTX/SASS.
- ``python -m bert_ds.kernels.bench``: the kernels against PyTorch at BERT shapes, with a
  roofline line per op (GPU).

The imports point one way, ``_build`` <- ``dispatch``, ``compiled`` <- the ops <- ``selfcheck``
<- ``speed`` <- ``choice`` (``tests/test_layers.py`` checks it): the dispatch consults the
self-check's verdicts made by running the ops, so ``choice`` hands them to it as it is
imported (:func:`dispatch.consult`) instead of the dispatch importing them; the race's reach
it inside the plan.

This ``__init__`` imports nothing: the commands above (``python -m bert_ds.kernels.X``) run it
first, and ``--help`` or a mistyped flag must answer without importing torch.
"""
