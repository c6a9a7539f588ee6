"""bert_ds.model.bert.model against transformers' BertForPreTraining with identical weights, and its
training path free of host syncs."""

import dataclasses
import subprocess
import sys

import pytest
import torch
import transformers
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from bert_ds.loader.pretraining import to_device
from bert_ds.base.errors import ConfigError
from bert_ds.checkpoint.export import to_hf_config
from bert_ds.kernels.ops import OpPlan
from bert_ds.kernels.layer_norm import layer_norm_native
from bert_ds.model.build import meta_model
from bert_ds.model.families import PRESETS, family_of_preset, model_preset
from bert_ds.model.bert.model import BertForPreTraining, BertSublayerOutput
from bert_ds.model.bert.config import ModelConfig
from bert_ds.model.padding import pretraining_inputs, unpad
from tests.conftest import REPO

pytestmark = pytest.mark.lowest  # all of it also runs under the lowest supported torch (run.sh test-lowest)

VOCAB = 97
SEQ = 16
LENGTHS = [SEQ, 1, 7, 11]  # full, a lone [CLS], two in between


def _config(**overrides) -> ModelConfig:
    values = dict(vocab_size=VOCAB, hidden_size=48, num_layers=2, num_heads=3, intermediate_size=80,
                  max_position_embeddings=24, hidden_dropout=0.0, attention_dropout=0.0, kernels="torch")
    return ModelConfig(**{**values, **overrides})


def _models(config: ModelConfig, seed: int = 0):
    """Our model and transformers' with the same weights."""
    torch.manual_seed(seed)
    ours = BertForPreTraining(config)
    hf_config = to_hf_config(config)
    hf_config._attn_implementation = "eager"
    theirs = transformers.BertForPreTraining(hf_config)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    return ours, theirs


def _batch(seed: int, lengths=LENGTHS, seq_len: int = SEQ, mask_prob: float = 0.3):
    generator = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    attention_mask = (torch.arange(seq_len)[None, :] < torch.tensor(lengths)[:, None]).long()
    input_ids = torch.randint(1, VOCAB, (batch, seq_len), generator=generator) * attention_mask
    token_type_ids = (torch.arange(seq_len)[None, :] >= torch.tensor(lengths)[:, None] // 2).long()
    token_type_ids = token_type_ids * attention_mask
    masked = (torch.rand(batch, seq_len, generator=generator) < mask_prob) & attention_mask.bool()
    masked[0, 1] = True  # at least one masked token
    labels = torch.where(masked, torch.randint(0, VOCAB, (batch, seq_len), generator=generator), -100)
    next_sentence = torch.randint(0, 2, (batch,), generator=generator)
    return input_ids, token_type_ids, attention_mask, labels, next_sentence


def _loader_batch(batch) -> dict:
    """``_batch`` as the loader delivers it: the padded tensors and the precomputed layout."""
    input_ids, token_type_ids, attention_mask, labels, next_sentence = batch
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
            "labels": labels, "next_sentence_label": next_sentence, **unpad(attention_mask, labels).batch_fields()}


# The two ways into the model: the training path (layout precomputed on the host, as the
# loader delivers it) and Hugging Face's arguments (layout computed inside the forward).
PATHS = ["precomputed", "attention_mask"]


def _ours(model, batch, path: str):
    if path == "precomputed":
        return model(**pretraining_inputs(_loader_batch(batch)))
    return model(*batch)


def _run_both(ours, theirs, batch, path: str = "precomputed"):
    input_ids, token_type_ids, attention_mask, labels, next_sentence = batch
    our_out = _ours(ours, batch, path)
    their_out = theirs(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                       labels=labels, next_sentence_label=next_sentence)
    return our_out, their_out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# --------------------------------------------------------------------------- equivalence with HF

@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_tanh"])
def test_matches_transformers_in_eval(hidden_act, path):
    ours, theirs = _models(_config(hidden_act=hidden_act))
    ours.eval()
    theirs.eval()
    batch = _batch(seed=1)
    labels, next_sentence = batch[3], batch[4]
    with torch.no_grad():
        our_out, their_out = _run_both(ours, theirs, batch, path)

    is_masked = labels != -100
    their_mlm = their_out.prediction_logits[is_masked]
    assert our_out.mlm_logits.shape == (int(is_masked.sum()), VOCAB)
    assert _max_diff(our_out.mlm_logits, their_mlm) <= 1e-5
    assert _max_diff(our_out.nsp_logits, their_out.seq_relationship_logits) <= 1e-5
    assert _max_diff(our_out.loss, their_out.loss) <= 1e-5
    their_mlm_loss = torch.nn.functional.cross_entropy(their_mlm, labels[is_masked])
    assert _max_diff(our_out.mlm_loss, their_mlm_loss) <= 1e-5
    their_nsp_loss = torch.nn.functional.cross_entropy(their_out.seq_relationship_logits, next_sentence)
    assert _max_diff(our_out.nsp_loss, their_nsp_loss) <= 1e-5

    assert our_out.mlm_count.item() == is_masked.sum().item()
    assert our_out.mlm_correct.item() == (their_mlm.argmax(-1) == labels[is_masked]).sum().item()
    assert our_out.nsp_count.item() == len(LENGTHS)
    assert our_out.nsp_correct.item() == (their_out.seq_relationship_logits.argmax(-1) == next_sentence).sum().item()


def test_gelu_variants_differ():
    """The hidden_act switch reaches the model (otherwise the test above proves nothing for it)."""
    batch = _batch(seed=1)
    outs = []
    for hidden_act in ("gelu", "gelu_tanh"):
        ours, _ = _models(_config(hidden_act=hidden_act))
        with torch.no_grad():
            outs.append(ours.eval()(*batch[:3]).mlm_logits)
    assert _max_diff(outs[0], outs[1]) > 1e-7


def test_without_labels_returns_logits_of_every_real_token():
    ours, theirs = _models(_config())
    input_ids, token_type_ids, attention_mask, _, _ = _batch(seed=2)
    with torch.no_grad():
        our_out = ours.eval()(input_ids, token_type_ids, attention_mask)
        their_out = theirs.eval()(input_ids=input_ids, token_type_ids=token_type_ids,
                                  attention_mask=attention_mask)
    assert our_out.loss is None and our_out.mlm_loss is None and our_out.nsp_loss is None
    assert _max_diff(our_out.mlm_logits, their_out.prediction_logits[attention_mask.bool()]) <= 1e-5


def test_state_dict_keys_and_shapes_match_transformers():
    ours, theirs = _models(_config())
    our_state, their_state = ours.state_dict(), theirs.state_dict()
    # transformers' position_ids / token_type_ids buffers are non-persistent, so absent here too.
    assert set(our_state) == set(their_state)
    for name, tensor in their_state.items():
        assert our_state[name].shape == tensor.shape, name
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    assert ours.cls.predictions.decoder.bias is ours.cls.predictions.bias


def test_init_is_huggingface_style():
    config = _config(initializer_range=0.05)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    query = model.bert.encoder.layer[0].attention.self.query
    assert abs(query.weight.std().item() - 0.05) < 0.01
    assert torch.all(query.bias == 0)
    words = model.bert.embeddings.word_embeddings.weight
    assert torch.all(words[config.pad_token_id] == 0)
    assert abs(words[1:].std().item() - 0.05) < 0.01
    norm = model.bert.encoder.layer[0].output.LayerNorm
    assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)
    assert torch.all(model.cls.predictions.bias == 0)


@pytest.mark.parametrize("path", PATHS)
def test_training_steps_match_transformers(path):
    """20 AdamW steps in fp32 give the same losses as transformers + torch.optim.AdamW."""
    ours, theirs = _models(_config())
    ours.train()
    theirs.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (ours, theirs)]
    for step in range(20):
        our_out, their_out = _run_both(ours, theirs, _batch(seed=100 + step), path)
        for opt, loss in zip(opts, (our_out.loss, their_out.loss)):
            opt.zero_grad()
            loss.backward()
            opt.step()
        rel = abs(our_out.loss.item() - their_out.loss.item()) / abs(their_out.loss.item())
        assert rel <= 1e-4, f"step {step}: {our_out.loss.item()} vs {their_out.loss.item()}"
    # Training moved the weights, so the comparison covered more than the initial point.
    assert not torch.equal(ours.bert.encoder.layer[0].attention.self.query.weight,
                           BertForPreTraining(_config()).bert.encoder.layer[0].attention.self.query.weight)


# --------------------------------------------------------------------------- options

def _loss_and_grads(model, batch, seed):
    torch.manual_seed(seed)  # same dropout masks in both runs
    model.zero_grad()
    loss = model(*batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_activation_checkpointing_gives_same_loss_and_grads():
    config = _config(hidden_dropout=0.1)
    plain, _ = _models(config)
    checkpointed = BertForPreTraining(dataclasses.replace(config, activation_checkpointing=True))
    checkpointed.load_state_dict(plain.state_dict())
    calls = []
    # A module inside the checkpointed layer: it runs again when backward recomputes the layer.
    checkpointed.bert.encoder.layer[0].intermediate.register_forward_hook(lambda *_: calls.append(1))

    batch = _batch(seed=3)
    loss_a, grads_a = _loss_and_grads(plain.train(), batch, seed=7)
    loss_b, grads_b = _loss_and_grads(checkpointed.train(), batch, seed=7)
    assert len(calls) == 2  # forward, then the recomputation in backward
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=0, atol=1e-7, msg=name)


def test_qkv_in_one_gemm_trains_as_the_three_projections_zero3_runs(monkeypatch):
    """Q, K and V from one GEMM of the three weights side by side, against the three Linear
    modules that run where ZeRO-3 partitions the weights (each fetches its own as it runs): the
    same loss and the same gradient of each of the three in fp32. The weights keep HF's names."""
    from bert_ds.model.bert import model as bert

    model, _ = _models(_config())
    batch = _batch(seed=3)
    loss_one, grads_one = _loss_and_grads(model.train(), batch, seed=7)
    monkeypatch.setattr(bert, "_gathered_by_its_module", lambda param: True)
    loss_three, grads_three = _loss_and_grads(model, batch, seed=7)
    torch.testing.assert_close(loss_one, loss_three, rtol=1e-6, atol=0)
    assert {"bert.encoder.layer.0.attention.self.query.weight", "bert.encoder.layer.0.attention.self.value.bias"} \
        <= set(grads_one)
    for name in grads_one:
        torch.testing.assert_close(grads_one[name], grads_three[name], rtol=1e-5, atol=1e-6, msg=name)
    partitioned = torch.nn.Parameter(torch.zeros(2))
    partitioned.ds_id = 3  # what DeepSpeed's ZeRO-3 sets on the parameters it partitions
    monkeypatch.undo()
    assert bert._gathered_by_its_module(partitioned) and not bert._gathered_by_its_module(torch.nn.Parameter())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_post_ln_sublayer_on_kernels_torch_computes_what_its_modules_did(dropout):
    """kernels=torch: LayerNorm(dropout(dense(x)) + residual) bit for bit as nn.Linear (its bias in
    the GEMM), nn.Dropout (the same draws of torch's generator) and the native LayerNorm computed it,
    forward and backward: the golden run's record rests on it."""
    torch.manual_seed(0)
    layer = BertSublayerOutput(256, _config(hidden_dropout=dropout), "torch").train()  # 256: addmm != mm + add
    x, residual, grad_out = torch.randn(130, 256), torch.randn(130, 48), torch.randn(130, 48)
    ln = layer.LayerNorm

    def run(fn):
        layer.zero_grad()
        leaves = [x.clone().requires_grad_(), residual.clone().requires_grad_()]
        torch.manual_seed(1)
        out = fn(*leaves)
        out.backward(grad_out)
        return [out.detach(), *(t.grad for t in leaves), *(p.grad.clone() for p in layer.parameters())]

    ours = run(layer)
    before = run(lambda x, r: layer_norm_native(layer.dropout(layer.dense(x)), ln.weight, ln.bias, ln.eps, r))
    assert all(torch.equal(a, b) for a, b in zip(ours, before))


def test_post_ln_sublayer_hands_the_dense_bias_to_the_op_where_it_runs_fused():
    native = OpPlan((("dropout_add_layer_norm", "native"),), "shapes")
    fused = OpPlan((("dropout_add_layer_norm", "fused"),), "shapes")
    for backend, in_gemm in (("torch", True), ("cuda", False), (native, True), (fused, False)):
        assert BertSublayerOutput(80, _config(), backend).bias_in_gemm is in_gemm, backend


def test_pre_layernorm_runs_forward_and_backward():
    config = _config(pre_layernorm=True, hidden_dropout=0.1)
    torch.manual_seed(0)
    model = BertForPreTraining(config).train()
    extra = set(model.state_dict()) - set(BertForPreTraining(_config()).state_dict())
    assert extra == {"bert.encoder.LayerNorm.weight", "bert.encoder.LayerNorm.bias"}
    out = model(*_batch(seed=4))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model.bert.encoder.LayerNorm.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_padded_decoder_is_the_plain_decoder(autocast):
    """The decoder's GEMM runs 8-aligned (97 -> 104 columns): the real columns, the loss and every
    gradient are those of the unpadded F.linear, and a padding column never wins an argmax,
    even where every real logit is far below zero."""
    from bert_ds.model.mlm import padded_vocab_size
    assert [padded_vocab_size(v) for v in (97, 104, 30522, 4096)] == [104, 104, 30528, 4096]
    torch.manual_seed(0)
    model = BertForPreTraining(_config())
    decoder = model.cls.predictions.decoder
    with torch.no_grad():
        model.cls.predictions.bias.fill_(-1e4)  # every real logit about -1e4: -inf must still lose
    x = torch.randn(6, 48, requires_grad=True)
    labels = torch.tensor([0, 5, 96, 50, 3, 1])
    results = []
    for padded in (True, False):
        model.zero_grad()
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = decoder(x) if padded else torch.nn.functional.linear(x, decoder.weight, decoder.bias)
            loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        loss.backward()
        results.append((logits.detach(), loss.detach(), x.grad.clone(), decoder.weight.grad.clone(),
                        decoder.bias.grad.clone()))
    (padded, loss_p, *grads_p), (plain, loss_u, *grads_u) = results
    assert padded.shape == (6, 104) and plain.shape == (6, VOCAB)
    assert torch.equal(padded[:, VOCAB:], torch.full_like(padded[:, VOCAB:], float("-inf")))
    assert (padded.argmax(dim=-1) < VOCAB).all()
    tolerance = dict(rtol=1e-2, atol=1e-2) if autocast else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(padded[:, :VOCAB], plain, **tolerance)
    torch.testing.assert_close(loss_p, loss_u, **tolerance)
    for a, b in zip(grads_p, grads_u):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, **tolerance)


def test_no_masked_tokens_gives_zero_mlm_loss():
    model = BertForPreTraining(_config())
    input_ids, token_type_ids, attention_mask, labels, next_sentence = _batch(seed=5)
    out = model(input_ids, token_type_ids, attention_mask, torch.full_like(labels, -100), next_sentence)
    assert out.mlm_logits.shape == (0, VOCAB)
    assert out.mlm_loss.item() == 0.0 and out.mlm_count.item() == 0
    assert torch.equal(out.loss, out.nsp_loss)


def test_precomputed_and_mask_paths_agree_exactly():
    model = BertForPreTraining(_config()).eval()
    batch = _batch(seed=8)
    with torch.no_grad():
        a, b = (_ours(model, batch, path) for path in PATHS)
    for name in ("mlm_logits", "nsp_logits", "loss", "mlm_loss", "nsp_loss", "mlm_correct", "mlm_count",
                 "nsp_correct", "nsp_count"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_forward_takes_the_layout_one_way_only():
    model = BertForPreTraining(_config())
    input_ids, token_type_ids, attention_mask, labels, _ = _batch(seed=9)
    unpadded = unpad(attention_mask, labels)
    with pytest.raises(ValueError, match="exactly one of attention_mask"):
        model(input_ids, token_type_ids)
    with pytest.raises(ValueError, match="exactly one of attention_mask"):
        model(input_ids, token_type_ids, attention_mask, unpadded=unpadded)
    with pytest.raises(ValueError, match="unpadded.masked_labels"):
        model(input_ids, token_type_ids, masked_lm_labels=labels, unpadded=unpadded)


# --------------------------------------------------------------------------- no host sync in training

def _compiled_keeping_graphs(model):
    """``model`` compiled whole (``fullgraph=True``), and the list that receives the
    forward and backward aten graphs AOTAutograd traces; they run as traced (no code
    generation: inductor's C++ compilation adds ~25 s on a CPU and tells nothing about syncs)."""
    graphs = []

    def keep(graph_module, example_inputs):
        graphs.append(graph_module)
        return make_boxed_func(graph_module.forward)

    return torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep)), graphs


_INDEXING = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default)
_VALUE_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


def _host_reads(graphs) -> list[str]:
    """Ops of the graphs that need device values on the host: a result whose size depends
    on values (``.nonzero()``, a boolean-mask index) or a value read back (``.item()``,
    ``.tolist()``).

    ``fullgraph=True`` alone does not refuse them: the compiler captures them and learns
    the sizes at run time, and once a later op ties such a size to a known one, no size in
    the graph shows it any more. So the ops themselves are looked at.
    """
    found = []
    for graph in graphs:
        for node in graph.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            if node.target in _INDEXING:  # tagged for boolean indices; integer ones gather or scatter
                reads = any(isinstance(i, torch.fx.Node) and i.meta["val"].dtype == torch.bool for i in node.args[1])
            else:
                reads = any(tag in node.target.tags for tag in _VALUE_DEPENDENT)
            if reads or free_unbacked_symbols(node.meta.get("val")):
                found.append(str(node.target))
    return found


@pytest.mark.parametrize("fn", [
    lambda x, y: x[x > 0].sum(),
    lambda x, y: x.nonzero().sum(),
    lambda x, y: (x[x > 0] * y).sum(),  # the mask's count is tied to y's known size
    lambda x, y: x.masked_fill(x > 0, 0.0).index_put((x > 1,), y.new_zeros(())).sum(),
], ids=["mask-index", "nonzero", "mask-index-sized", "mask-index-put"])
def test_graph_check_sees_host_reads(fn):
    """The check below can fail."""
    torch._dynamo.reset()
    compiled, graphs = _compiled_keeping_graphs(fn)
    compiled(torch.tensor([1.0, -1.0, 2.0, -3.0, 4.0]), torch.ones(3))
    assert _host_reads(graphs)


def test_training_forward_compiles_whole_and_matches_eager():
    """The training path (layout precomputed by the loader) compiles into one graph, whose
    forward and backward read no device value on the host, and computes what eager does."""
    config = _config(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = BertForPreTraining(config).train()  # dropout 0: eager and compiled compute the same function
    inputs = pretraining_inputs(_loader_batch(_batch(seed=6)))
    torch._dynamo.reset()
    compiled, graphs = _compiled_keeping_graphs(model)

    results = []
    for run in (compiled, model):
        model.zero_grad()
        loss = run(**inputs).loss
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    assert len(graphs) == 2  # one forward graph, one backward graph
    assert _host_reads(graphs) == []
    (compiled_loss, compiled_grads), (eager_loss, eager_grads) = results
    # The same fp32 ops on the same values: at most rounding apart (they come out equal here).
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-6)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=0, atol=1e-6, msg=name)

    # The attention_mask path computes the layout in the forward, from device values: it cannot compile whole.
    input_ids, token_type_ids, attention_mask, labels, _ = _batch(seed=6)
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError)):
        _compiled_keeping_graphs(model)[0](input_ids, token_type_ids, attention_mask, labels)


def test_compiled_layers_train_as_eager_layers_do_and_compile_once(monkeypatch):
    """``compile_layers``: each encoder layer under torch.compile (Inductor, as a training run
    compiles it), with the attention on the fused kernel as a GPU's plan would have it (a
    stand-in extension computes it here, through the op's real dispatch and custom op).
    Loss and gradients are eager's within rounding (Inductor fuses the fp32 sums in its own
    order); batches of other token counts, batch sizes and longest sequences compile nothing
    new; the parameters keep their names (checkpoints and the export do not change)."""
    from torch._dynamo.utils import counters

    from bert_ds.kernels import attention
    from bert_ds.kernels.dispatch import OPS
    from bert_ds.model import backend
    from tests.kernels.helpers import StandInAttentionExtension

    extension = StandInAttentionExtension()
    monkeypatch.setattr(attention, "fused_extension", lambda: extension)
    monkeypatch.setattr(attention, "_unsupported", lambda impl, *inputs: "")  # CPU tensors pass for CUDA ones
    plan = OpPlan(tuple((op, "fused" if op == "varlen_attention" else "native") for op in OPS), "test")
    monkeypatch.setattr(backend, "resolve_backend", lambda setting, shapes: plan)
    config = _config(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    eager = BertForPreTraining(config).train()  # dropout 0: both compute the same function
    compiled = BertForPreTraining(dataclasses.replace(config, compile_layers=True)).train()
    assert list(compiled.state_dict()) == list(eager.state_dict())
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    for seed, lengths in enumerate(([SEQ, 1, 7, 11], [5, SEQ, SEQ], [3, 9, 2, 12, 4])):  # the last: max 12 < SEQ
        (compiled_loss, compiled_grads), (eager_loss, eager_grads) = (
            _loss_and_grads(model, _batch(seed=seed, lengths=lengths), seed=0) for model in (compiled, eager))
        torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-5)
        for name, grad in eager_grads.items():
            torch.testing.assert_close(compiled_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # the two layers share it
    assert extension.calls == 3 * 2 * 2  # three batches, two layers, both models: the fused op ran


@pytest.mark.parametrize("options", [{}, {"activation_checkpointing": True, "pre_layernorm": True}])
def test_training_step_runs_on_the_meta_device(options):
    """The eager training step, as train.py runs it, reads no device value on the host:
    on the meta device, where tensors have shapes but no values, any ``.item()``,
    ``.tolist()``, ``.nonzero()`` or boolean-mask index raises."""
    config = _config(hidden_dropout=0.1, **options)
    batch = to_device(_loader_batch(_batch(seed=7)), torch.device("meta"))
    with torch.device("meta"):
        model = BertForPreTraining(config).train()
    out = model(**pretraining_inputs(batch))
    out.loss.backward()
    assert out.loss.is_meta and out.mlm_logits.shape == (batch["masked_labels"].numel(), VOCAB)
    assert all(p.grad is not None and p.grad.is_meta for p in model.parameters())
    # The attention_mask path reads the layout's sizes back from the device, so it cannot run here.
    with pytest.raises(NotImplementedError, match="meta"):
        model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch["labels"])


def test_rejects_sequences_longer_than_position_table():
    model = BertForPreTraining(_config(max_position_embeddings=8))
    ids = torch.ones(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(ids, torch.zeros_like(ids), torch.ones_like(ids))


# --------------------------------------------------------------------------- config

@pytest.mark.parametrize("field, value", [
    ("vocab_size", 0),
    ("hidden_size", -64),
    ("num_layers", 2.5),
    ("num_heads", 5),  # does not divide hidden_size=48
    ("intermediate_size", True),
    ("max_position_embeddings", 0),
    ("type_vocab_size", 0),
    ("hidden_act", "relu"),
    ("hidden_dropout", 1.0),
    ("attention_dropout", -0.1),
    ("layer_norm_eps", 0.0),
    ("initializer_range", -0.02),
    ("pre_layernorm", "yes"),
    ("kernels", "triton"),
    ("activation_checkpointing", 1),
    ("compile_layers", "no"),
    ("pad_token_id", VOCAB),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ConfigError, match=field):
        _config(**{field: value})


def test_config_dict_round_trip():
    config = _config(hidden_act="gelu_tanh", pre_layernorm=True)
    assert ModelConfig.from_dict(config.to_dict()) == config


def test_config_from_dict_rejects_unknown_and_missing_keys():
    with pytest.raises(ConfigError, match="unknown keys hidden_layers"):
        ModelConfig.from_dict({**_config().to_dict(), "hidden_layers": 3})
    values = _config().to_dict()
    del values["vocab_size"]
    with pytest.raises(ConfigError, match="missing keys vocab_size"):
        ModelConfig.from_dict(values)


@pytest.mark.parametrize("name", [name for name in PRESETS if family_of_preset(name).config_class is ModelConfig])
def test_presets_build_with_transformers_parameter_count(name):
    config = model_preset(name, vocab_size=30522, kernels="torch")
    assert config.num_layers == PRESETS[name]["num_layers"]
    with torch.device("meta"):  # base and large without allocating their weights
        ours = BertForPreTraining(config)
        theirs = transformers.BertForPreTraining(to_hf_config(config))
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())


def test_a_meta_model_has_the_models_names_and_shapes_and_runs_no_initialisation():
    config = model_preset("tiny", vocab_size=300, kernels="torch")
    real = BertForPreTraining(config).state_dict()
    meta = meta_model(config)
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in real.items()}
    assert all(p.is_meta for p in meta.parameters())
    assert meta.cls.predictions.decoder.weight is meta.bert.embeddings.word_embeddings.weight  # still tied
    # No fill reached torch: normal_ on a meta tensor imports torch._dynamo (seconds), which
    # export and the docs' parameter counts would pay for nothing. A fresh process shows it.
    code = ("import sys; from bert_ds.model.build import meta_model; from bert_ds.model.families import model_preset; "
            "meta_model(model_preset('base', 30522)); print('torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.split() == ["False"], proc.stderr[-2000:]


def test_preset_overrides_and_unknown_name():
    assert model_preset("tiny", vocab_size=100, hidden_dropout=0.0).hidden_dropout == 0.0
    with pytest.raises(ConfigError, match="tiny, tiny-h128, mini, base, large"):
        model_preset("huge", vocab_size=100)
    with pytest.raises(ConfigError, match="unknown keys"):
        model_preset("tiny", vocab_size=100, dropout=0.0)
