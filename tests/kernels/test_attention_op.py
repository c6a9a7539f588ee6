"""The packed fused attention as torch.compile sees it: a custom op (``bert_ds::packed_attention_fwd``
and its backward), whose declared shapes, autograd and graph node are checked here.

The fused kernels need a GPU, so a stand-in extension answers for them on the CPU: attention
written out per sequence (scores, logsumexp, softmax and its gradient), independently of the
reference's padded SDPA, and checked against that reference first. What is tested is the
op's wiring, which is the same code on a GPU: the extension's calls, the shapes declared for
the compiler, the backward registered as the forward's gradient, and the compiled graph
holding the op as one node at any token count.
"""

import math

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.library import opcheck

from bert_ds.kernels import attention
from tests.kernels.helpers import StandInAttentionExtension, cu_seqlens_of, rand

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

HEADS, HEAD_DIM = 2, 8
SCALE = 1 / math.sqrt(HEAD_DIM)


@pytest.fixture
def stand_in(monkeypatch):
    extension = StandInAttentionExtension()
    monkeypatch.setattr(attention, "fused_extension", lambda: extension)
    return extension


def _qkv(lengths, dtype=torch.float32, seed=1):
    return rand(sum(lengths), 3, HEADS, HEAD_DIM, dtype=dtype, seed=seed).requires_grad_(), cu_seqlens_of(lengths)


def test_the_stand_in_computes_the_reference(stand_in):
    """What the stand-in answers is attention: the reference's output and gradient."""
    qkv, cu_seqlens = _qkv([5, 1, 7])
    dout = rand(13, HEADS, HEAD_DIM, seed=9)
    ours = attention.varlen_attention_packed_fused(qkv, cu_seqlens, 7)
    assert type(ours.grad_fn).__name__ == "FusedVarlenAttentionPackedBackward"  # eager: the cheaper dispatch
    (ours_grad,) = torch.autograd.grad(ours, qkv, dout)
    reference = attention.varlen_attention_ref(*qkv.unbind(1), cu_seqlens, 7)
    (reference_grad,) = torch.autograd.grad(reference, qkv, dout)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_grad, reference_grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("lengths", [[3, 5, 5], [1], [4, 9]])
def test_the_op_passes_torch_opcheck(stand_in, lengths):
    """Schema, declared shapes against the kernels' outputs, the registered gradient, and the
    op traced with symbolic sizes (torch.library.opcheck)."""
    qkv, cu_seqlens = _qkv(lengths)
    results = opcheck(torch.ops.bert_ds.packed_attention_fwd.default, (qkv, cu_seqlens, max(lengths), SCALE, -1, 0.0))
    assert set(results.values()) == {"SUCCESS"}, results


def test_opcheck_finds_a_kernel_whose_output_differs_from_the_declared_shapes(stand_in):
    stand_in.transpose_lse = True
    qkv, cu_seqlens = _qkv([3, 4])
    with pytest.raises(Exception, match=r"test_faketensor failed .* output\[1\]: Shapes"):
        opcheck(torch.ops.bert_ds.packed_attention_fwd.default, (qkv, cu_seqlens, 4, SCALE, -1, 0.0))


def test_a_compiled_graph_holds_the_op_as_one_node_at_any_token_count(stand_in):
    """Compiled whole (``fullgraph=True``): the forward graph calls the forward op, the backward
    graph the backward op, the results are eager's, and new token and sequence counts compile
    nothing new."""
    graphs, compiles = [], []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    def count(graph_module, example_inputs):
        compiles.append(graph_module)
        return aot_autograd(fw_compiler=keep, bw_compiler=keep)(graph_module, example_inputs)

    def attend(qkv, cu_seqlens, max_seqlen):
        return attention.varlen_attention_packed_fused(qkv, cu_seqlens, max_seqlen)

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend=count)
    for lengths in ([3, 5, 8], [8, 2], [1, 8, 4, 6]):
        qkv, cu_seqlens = _qkv(lengths, seed=len(lengths))
        torch._dynamo.maybe_mark_dynamic(qkv, 0)
        torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
        dout = rand(sum(lengths), HEADS, HEAD_DIM, seed=7)
        results = []
        for run in (compiled, attend):
            out = run(qkv, cu_seqlens, 8)
            results.append((out, *torch.autograd.grad(out, qkv, dout)))
        for a, b in zip(*results):
            assert torch.equal(a, b)
    assert len(compiles) == 1
    targets = [{node.target for node in g.graph.nodes} for g in graphs]
    assert torch.ops.bert_ds.packed_attention_fwd.default in targets[0]
    assert torch.ops.bert_ds.packed_attention_bwd.default in targets[1]
