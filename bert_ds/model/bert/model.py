"""BERT for pretraining (masked LM + next-sentence prediction), run unpadded.

Design choices, and why:

- **Hugging Face parameter names.** Every parameter has the name and shape it has
  in ``transformers.BertForPreTraining``, and the fused kernels live in functions,
  not in modules with their own parameters. A checkpoint therefore exports by
  copying tensors, and turning the kernels on or off never changes it.
- **No position_ids / token_type_ids buffers.** Hugging Face registers them as
  non-persistent buffers, so they are absent from its ``state_dict``; we compute
  position ids from the unpadded layout instead. Our ``state_dict`` keys equal
  Hugging Face's exactly, including the tied aliases ``cls.predictions.decoder.weight``
  (= the word embedding) and ``cls.predictions.decoder.bias`` (= ``cls.predictions.bias``).
- **Padding is removed once**, before the embeddings. Every layer then runs on
  (T, H) real tokens, T = number of non-pad tokens, so no GEMM or LayerNorm is
  spent on padding; attention gets ``cu_seqlens`` (the flash-attention varlen
  convention). Only the reference attention re-pads internally.
- **The unpadded layout comes with the batch.** Token indices, ``cu_seqlens``,
  ``max_seqlen`` and the masked rows have data-dependent sizes; the loader computes
  them on the host (:mod:`bert_ds.model.padding`), so the training forward and backward
  only gather and never wait for the device (no ``.item()``, ``.tolist()``,
  ``.nonzero()`` or boolean-mask index): ``torch.compile(fullgraph=True)`` takes it
  whole. Callers with only an ``attention_mask`` still get it computed here.
- **The MLM decoder runs only on masked positions** (~15% of tokens), its GEMM padded to a
  multiple of 8 rows, the loss in fp32 math: :mod:`bert_ds.model.mlm`, which every model
  family shares.
- **Q, K and V come from one GEMM** of the three weights side by side (3H columns). Its
  backward is one GEMM for the input's gradient, where three GEMMs and two adds of a (T, H)
  tensor were, and one bias reduction; the fused attention reads q, k and v from the
  (T, 3, nh, hd) result in place and returns its gradient in one piece. The three
  ``nn.Linear`` modules stay, with HF's names; under ZeRO-3, which gathers a partitioned
  weight for its own module's forward, each runs as before.
- **Post-LN by default** (the original BERT, exportable). ``pre_layernorm=True``
  normalises each sublayer's input instead and adds a final
  ``bert.encoder.LayerNorm``: stabler at depth or with high learning rates, but
  ``transformers.BertForPreTraining`` has no such layout, so it cannot be exported.
- **Two ways to fuse the elementwise work.** By hand (the fused ops of :mod:`kernels`), or with
  ``compile_layers`` by Inductor: each encoder layer under ``torch.compile`` (whole, no graph
  break) on PyTorch's ops, the attention as the kernels setting picks it, the fused kernel as a
  custom op. The token count is symbolic and every batch up to training's length is handed that
  length as its longest, so the layers compile once. Which is faster is measured per GPU (the
  bench's variant (d), the engine sweep's ``compiled``); the hand-fused path is the default.
- **Kernels are resolved once**, at construction, from ``ModelConfig.kernels`` and the
  model's shapes at the training's sequence length; the ops in :mod:`kernels` receive the
  resolved backend on every call (under ``kernels=auto`` the plan of the winners at these
  shapes, so a phase-2 model at seq 512 runs its own, not phase 1's).
"""


import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bert_ds.kernels.ops import (
    Backend, OpPlan, bias_gelu, dropout_add_layer_norm, layer_norm, varlen_attention, varlen_attention_packed,
)
from bert_ds.model.backend import model_backend
from bert_ds.model.bert.config import ModelConfig
from bert_ds.model.config import GELU_APPROXIMATE
from bert_ds.model.mlm import MlmDecoder, PreTrainingOutput, device_count, masked_lm, vocab_columns
from bert_ds.model.padding import Unpadded, gather_tokens, input_layout


# --------------------------------------------------------------------------- modules

class LayerNorm(nn.Module):
    """LayerNorm over the last dim, optionally of ``x + residual`` in one fused op.

    Parameters are named ``weight`` and ``bias`` like ``nn.LayerNorm``'s, so the
    checkpoint keys match Hugging Face's.
    """

    def __init__(self, hidden_size: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, residual, backend=self.backend)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size,
                                            padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, backend)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """All inputs (T,) int64; returns (T, H)."""
        # Summed in Hugging Face's order, so fp32 results agree bit for bit.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_dropout
        self.backend = backend

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """hidden: (T, H) -> context (T, H), before the output projection."""
        dropout_p = self.dropout_p if self.training else 0.0
        if _gathered_by_its_module(self.query.weight):  # ZeRO-3: each Linear fetches its weights as it runs
            q, k, v = (layer(hidden).view(-1, self.num_heads, self.head_dim) for layer in (self.query, self.key,
                                                                                           self.value))
            context = varlen_attention(q, k, v, cu_seqlens, max_seqlen, dropout_p=dropout_p, backend=self.backend)
        else:
            # Q, K and V in one GEMM of 3H columns. Its backward is one GEMM for the input's
            # gradient (three, and two adds of (T, H), otherwise) and one bias reduction; the
            # fused attention reads q, k, v from the (T, 3, nh, hd) result in place and hands
            # its gradient back in one piece. The weights stay three modules: HF's names.
            weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])  # (3H, H)
            bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
            qkv = F.linear(hidden, weight, bias).view(-1, 3, self.num_heads, self.head_dim)  # (T, 3, nh, hd)
            context = varlen_attention_packed(qkv, cu_seqlens, max_seqlen, dropout_p=dropout_p,
                                              backend=self.backend)  # (T, nh, hd)
        return context.reshape(-1, self.num_heads * self.head_dim)  # (T, H)


def _gathered_by_its_module(param: nn.Parameter) -> bool:
    """Whether ``param`` is partitioned by ZeRO-3 (DeepSpeed's ``ds_id``): DeepSpeed gathers it
    for its own module's forward, prefetched and released on its schedule. Read from another
    module it is gathered on the spot, outside that schedule, so the model leaves it to its module."""
    return hasattr(param, "ds_id")


class BertSublayerOutput(nn.Module):
    """Projection back to H, dropout, and the residual connection of a sublayer.

    Serves as both ``attention.output`` and ``output`` (HF's BertSelfOutput and
    BertOutput, which have the same parameters). Post-LN: ``LN(dropout(dense(x)) + residual)``,
    everything after the GEMM in one op (:func:`~bert_ds.kernels.ops.dropout_add_layer_norm`), which
    also takes the dense bias where it runs fused: the kernel adds it, and sums its gradient in its
    own backward. Where the op runs natively the GEMM adds the bias, as ``nn.Linear`` does: addmm
    rounds differently from a GEMM then an add (fp32, CPU, a 256-wide input), and ``kernels=torch``
    computes what it always has. Pre-LN: ``residual + dropout(dense(x))``; this module's
    ``LayerNorm`` is then applied by the caller to the sublayer's input.
    """

    def __init__(self, in_features: int, config: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, backend)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.pre_layernorm = config.pre_layernorm
        self.backend = backend
        self.bias_in_gemm = (backend.winner("dropout_add_layer_norm") == "native" if isinstance(backend, OpPlan)
                             else backend == "torch")

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x: (T, in_features), residual: (T, H) -> (T, H)."""
        if self.pre_layernorm:
            return residual + self.dropout(self.dense(x))
        ln = self.LayerNorm
        dropout_p = self.dropout.p if self.training else 0.0
        if self.bias_in_gemm:
            projected, bias = self.dense(x), None
        else:
            projected, bias = F.linear(x, self.dense.weight), self.dense.bias
        return dropout_add_layer_norm(projected, bias, residual, ln.weight, ln.bias, ln.eps, dropout_p,
                                      backend=self.backend)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend, attention_backend: Backend) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, attention_backend)
        self.output = BertSublayerOutput(config.hidden_size, config, backend)
        self.pre_layernorm = config.pre_layernorm

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        x = self.output.LayerNorm(hidden) if self.pre_layernorm else hidden
        return self.output(self.self(x, cu_seqlens, max_seqlen), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.approximate = GELU_APPROXIMATE[config.hidden_act]
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H) -> (T, I)."""
        # The bias is added inside the GELU kernel, saving a pass over the (T, I) tensor.
        return bias_gelu(F.linear(x, self.dense.weight), self.dense.bias, self.approximate,
                         backend=self.backend)


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend, attention_backend: Backend | None = None) -> None:
        """``attention_backend``: the attention's, where it differs from the other ops' ``backend``."""
        super().__init__()
        self.attention = BertAttention(config, backend, attention_backend or backend)
        self.intermediate = BertIntermediate(config, backend)
        self.output = BertSublayerOutput(config.intermediate_size, config, backend)
        self.pre_layernorm = config.pre_layernorm

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        """hidden: (T, H) -> (T, H)."""
        attended = self.attention(hidden, cu_seqlens, max_seqlen)
        x = self.output.LayerNorm(attended) if self.pre_layernorm else attended
        return self.output(self.intermediate(x), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend, train_seq_len: int) -> None:
        super().__init__()
        if config.compile_layers:
            # Inductor fuses the layer's elementwise work (bias adds, GELU, dropout, residuals,
            # LayerNorm) into kernels of its own, which it can only do with PyTorch's ops: the
            # fused ones are opaque to it. The attention runs what ``backend`` picks for it, the
            # fused kernel as one custom op of the graph (kernels/attention.py).
            self.layer = nn.ModuleList(BertLayer(config, "torch", backend) for _ in range(config.num_layers))
            for layer in self.layer:
                layer.compile(fullgraph=True)  # fullgraph: a graph break is an error, not a slow layer
        else:
            self.layer = nn.ModuleList(BertLayer(config, backend) for _ in range(config.num_layers))
        self.compiled = config.compile_layers
        self.train_seq_len = train_seq_len
        # Pre-LN leaves the residual stream unnormalised; the heads expect normalised input.
        self.LayerNorm = (LayerNorm(config.hidden_size, config.layer_norm_eps, backend)
                          if config.pre_layernorm else None)
        self.activation_checkpointing = config.activation_checkpointing

    def forward(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        if self.compiled:
            # The token count and the batch size change from batch to batch: symbolic from the first
            # compilation on, so that a new size is no new compilation. max_seqlen only bounds the
            # sequences (module doc of kernels/attention.py), so every batch of training's length or
            # shorter is handed that length: one value, no compilation for another (a longer batch,
            # in evaluation, compiles once more; a second such value makes it symbolic).
            torch._dynamo.maybe_mark_dynamic(hidden, 0)
            torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
            max_seqlen = max(max_seqlen, self.train_seq_len)
        for layer in self.layer:
            # Recomputation only pays off when a backward pass will follow.
            if self.activation_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, cu_seqlens, max_seqlen, use_reentrant=False)
            else:
                hidden = layer(hidden, cu_seqlens, max_seqlen)
        if self.LayerNorm is not None:
            hidden = self.LayerNorm(hidden)
        return hidden


class BertPooler(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """first_tokens: (B, H), each sequence's [CLS] state -> (B, H)."""
        return torch.tanh(self.dense(first_tokens))


class BertModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend, train_seq_len: int | None = None) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(config, backend)
        self.encoder = BertEncoder(config, backend, train_seq_len or config.max_position_embeddings)
        self.pooler = BertPooler(config)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed (T,) inputs -> hidden states (T, H) and pooled output (B, H)."""
        hidden = self.embeddings(input_ids, token_type_ids, position_ids)
        hidden = self.encoder(hidden, cu_seqlens, max_seqlen)
        pooled = self.pooler(hidden.index_select(0, cu_seqlens[:-1].long()))  # (B, H): each [CLS]
        return hidden, pooled


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, backend)
        self.approximate = GELU_APPROXIMATE[config.hidden_act]
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, H) -> (M, H)."""
        x = bias_gelu(F.linear(x, self.dense.weight), self.dense.bias, self.approximate, backend=self.backend)
        return self.LayerNorm(x)


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend, word_embeddings: nn.Parameter) -> None:
        super().__init__()
        self.transform = BertPredictionHeadTransform(config, backend)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        # Created on "meta" because both of its tensors are replaced by the tied ones at once:
        # the decoder shares the word embedding (as in BERT) and the bias registered above.
        self.decoder = MlmDecoder(config.hidden_size, config.vocab_size, device="meta")
        self.decoder.weight = word_embeddings
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (M, H) -> logits (M, V'), V' = :func:`bert_ds.model.mlm.padded_vocab_size` (V)."""
        return self.decoder(self.transform(x))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: ModelConfig, backend: Backend, word_embeddings: nn.Parameter) -> None:
        super().__init__()
        self.predictions = BertLMPredictionHead(config, backend, word_embeddings)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, predicted: torch.Tensor, pooled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """predicted: (M, H), pooled: (B, H) -> MLM logits (M, V'), NSP logits (B, 2)."""
        return self.predictions(predicted), self.seq_relationship(pooled)


# --------------------------------------------------------------------------- pretraining model

class BertForPreTraining(nn.Module):
    def __init__(self, config: ModelConfig, train_seq_len: int | None = None) -> None:
        """``train_seq_len``: the sequence length training feeds, at which ``kernels=auto``
        times its candidates the first time it meets this device with these shapes
        (default: ``max_position_embeddings``)."""
        super().__init__()
        self.config = config
        self.op_shapes, self.backend = model_backend(config, train_seq_len, config.hidden_act, config.hidden_dropout)
        self.bert = BertModel(config, self.backend, self.op_shapes.max_seqlen)
        self.cls = BertPreTrainingHeads(config, self.backend, self.bert.embeddings.word_embeddings.weight)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Hugging Face's BERT init: N(0, initializer_range) weights, zero biases, unit LayerNorms."""
        std = self.config.initializer_range
        decoder = self.cls.predictions.decoder
        for module in self.modules():
            # The decoder's tensors are the word embedding and cls.predictions.bias, set below and above;
            # initialising it as a Linear would overwrite the embedding's zeroed padding row.
            if isinstance(module, nn.Linear) and module is not decoder:
                module.weight.normal_(0.0, std)
                module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std)
                if module.padding_idx is not None:
                    module.weight[module.padding_idx].zero_()
            elif isinstance(module, LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()
        self.cls.predictions.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        masked_lm_labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        *,
        unpadded: Unpadded | None = None,
    ) -> PreTrainingOutput:
        """input_ids, token_type_ids: (B, S) int64, padding on the right; next_sentence_label:
        (B,), 0 = B follows A.

        Where the real and the masked tokens are comes one of two ways:

        - ``unpadded`` (training): the layout :func:`bert_ds.model.padding.unpad` computed on the
          host, as the loader delivers it (:func:`pretraining_inputs`). The forward and
          backward then never wait for the device. MLM losses are computed when it
          carries masked positions.
        - ``attention_mask`` (B, S) and optionally ``masked_lm_labels`` (B, S), ``IGNORE_INDEX`` (-100) where a
          token is not predicted (the Hugging Face arguments): the layout is computed here,
          which waits for the device once.

        Without masked positions the decoder runs on every real token instead (inference,
        export checks).
        """
        unpadded, position_ids = input_layout(input_ids, attention_mask, masked_lm_labels, unpadded,
                                              self.config.max_position_embeddings)
        token_indices, batch = unpadded.token_indices, input_ids.shape[0]
        hidden, pooled = self.bert(
            gather_tokens(input_ids, token_indices),
            gather_tokens(token_type_ids, token_indices),
            position_ids, unpadded.cu_seqlens, unpadded.max_seqlen,
        )  # (T, H), (B, H)

        mlm_labels = unpadded.masked_labels  # (M,) or None
        predicted = hidden if mlm_labels is None else hidden.index_select(0, unpadded.masked_positions)  # (M, H)
        mlm_logits, nsp_logits = self.cls(predicted, pooled)  # (M, V'), (B, 2)

        out = PreTrainingOutput(mlm_logits=vocab_columns(mlm_logits, self.config.vocab_size), nsp_logits=nsp_logits)
        if mlm_labels is not None:
            masked_lm(out, mlm_logits, mlm_labels, self.backend)
        if next_sentence_label is not None:
            out.nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label)
            out.nsp_correct = (nsp_logits.detach().argmax(dim=-1) == next_sentence_label).sum()
            out.nsp_count = device_count(batch, nsp_logits.device)
            out.loss = out.nsp_loss if out.loss is None else out.loss + out.nsp_loss
        return out
