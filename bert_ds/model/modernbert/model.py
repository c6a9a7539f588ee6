"""A ModernBERT-class encoder for masked-LM pretraining, run unpadded.

The architecture is transformers' ``ModernBertForMaskedLM`` (``models/modernbert``), which
ModernBERT, mmBERT and Ettin load as: token embeddings, a LayerNorm and dropout (no position
or segment embeddings); pre-LN layers (layer 0 without ``attn_norm``), each an attention of one
``Wqkv`` projection with rotary positions on Q and K and an output ``Wo``, then a GeGLU MLP
(``Wi`` to input and gate, ``Wo(gelu(input) * gate)``); no bias anywhere but the decoder's; a
final LayerNorm; an MLM head (dense, GELU, LayerNorm) and a decoder tied to the token
embeddings. Layer i attends globally where ``i % global_attn_every_n_layers == 0`` and within a
sliding window of ``local_attention`` tokens (+-half of it) elsewhere, with its own rotary base.

Design choices, and why:

- **Hugging Face parameter names and shapes**, so that a checkpoint exports by copying tensors
  (``model.embeddings.tok_embeddings.weight``, ``model.layers.{i}.attn.Wqkv.weight``, ...,
  ``decoder.bias``), and a ModernBERT folder initialises a run the same way.
- **Unpadded, as BERT runs here** (:mod:`bert_ds.model.bert.model`): the padding is removed once,
  before the embeddings, from the layout the loader computed on the host
  (:mod:`bert_ds.model.padding`); every layer runs on the T real tokens. Each sequence's rotary
  positions restart at its own first token (a token's position is its offset in its padded
  row), and a local window never reaches into another sequence (the attention ops attend
  within ``cu_seqlens``).
- **The attention through the kernels' ops**: the global layers through the op BERT uses
  (:func:`~bert_ds.kernels.ops.varlen_attention`), the local ones through
  :func:`~bert_ds.kernels.ops.local_attention`; ``kernels=auto`` picks each op's fastest
  correct implementation among PyTorch's own at the model's shapes (``kernels/speed.py``).
- **The MLP and the norms through the kernels' ops** too: the GeGLU activation on ``Wi``'s whole
  output (:func:`~bert_ds.kernels.ops.geglu`, whose fused kernel reads the input and gate halves in
  place) and every LayerNorm (:func:`~bert_ds.kernels.ops.layer_norm` with ``bias=None``), raced
  like the rest. Their native forms compute what ``nn.LayerNorm(bias=False)`` and
  ``F.gelu(input) * gate`` did here before, as transformers' model does (a CPU's half-precision
  LayerNorm aside, which takes the fp32 reference, as BERT's does).
- **Rotary embeddings in fp32**, as transformers applies them: cos and sin are computed in fp32
  and rounded to the model's dtype, q and k rotated in fp32 and rounded back. Where an attention
  op runs its fused kernel (``kernels=cuda``, or ``auto`` where it won the race) the layer hands
  the kernel the unrotated projection and its base instead, and the kernel rotates q and k as
  it loads them (``kernels/rotary_attention.py``: cos and sin in fp32, not rounded).
- **What BERT shares**: the padded, tied MLM decoder on the masked rows only and the fp32 loss
  (:mod:`bert_ds.model.mlm`), the output type, the unpadded layout. What differs is in this
  file; nothing in :mod:`bert_ds.model.bert.model` knows of it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from bert_ds.kernels.ops import Backend, geglu, layer_norm, rotary_attention
from bert_ds.kernels.rotary_attention import rotary_tables
from bert_ds.model.backend import model_backend
from bert_ds.model.config import GELU_APPROXIMATE
from bert_ds.model.modernbert.config import ModernBertConfig
from bert_ds.model.mlm import MlmDecoder, PreTrainingOutput, masked_lm, vocab_columns
from bert_ds.model.padding import Unpadded, gather_tokens, input_layout



class ModernBertLayerNorm(nn.LayerNorm):
    """ModernBERT's LayerNorm: a weight, no bias (``nn.LayerNorm(bias=False)``'s parameter, so its one
    key is transformers'), run by the kernels' op on the model's backend."""

    def __init__(self, hidden_size: int, eps: float, backend: Backend) -> None:
        super().__init__(hidden_size, eps=eps, bias=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, None, self.eps, backend=self.backend)


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: ModernBertConfig, backend: Backend) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.norm = ModernBertLayerNorm(config.hidden_size, config.norm_eps, backend)
        self.drop = nn.Dropout(config.embedding_dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (T,) -> (T, H)."""
        return self.drop(self.norm(self.tok_embeddings(input_ids)))


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModernBertConfig, layer: int, backend: Backend) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.Wqkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.Wo = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.out_drop = nn.Dropout(config.attention_dropout)
        self.dropout_p = config.attention_dropout
        # None: global; else the tokens seen on each side
        self.window = None if config.is_global(layer) else config.local_window
        self.rope_theta = config.global_rope_theta if config.is_global(layer) else config.local_rope_theta
        self.backend = backend

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        """hidden (T, H), rope: cos, sin (T, hd) -> (T, H)."""
        qkv = self.Wqkv(hidden).view(-1, 3, self.num_heads, self.head_dim)  # (T, 3, nh, hd): rows Q, K, V
        dropout_p = self.dropout_p if self.training else 0.0
        # Where the op runs fused, the kernels rotate q and k as they load them (this layer's base; each
        # sequence from position 0, as rope's): no rotated copy is written, and qkv's gradient comes back
        # whole. Anywhere else q and k are rotated by rope first.
        context = rotary_attention(qkv, cu_seqlens, max_seqlen, self.rope_theta, rope, self.window, dropout_p,
                                   backend=self.backend)
        return self.out_drop(self.Wo(context.reshape(-1, self.num_heads * self.head_dim)))  # (T, H)


class ModernBertMLP(nn.Module):
    """GeGLU: ``Wo(drop(gelu(input) * gate))`` with ``(input, gate) = Wi(x).chunk(2)``."""

    def __init__(self, config: ModernBertConfig, backend: Backend) -> None:
        super().__init__()
        self.Wi = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.Wo = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.drop = nn.Dropout(config.mlp_dropout)
        self.approximate = GELU_APPROXIMATE[config.hidden_activation]
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, H) -> (T, H)."""
        activated = geglu(self.Wi(x), self.approximate, backend=self.backend)  # (T, 2I) [input | gate] -> (T, I)
        return self.Wo(self.drop(activated))


class ModernBertEncoderLayer(nn.Module):
    def __init__(self, config: ModernBertConfig, layer: int, backend: Backend) -> None:
        super().__init__()
        # Layer 0's input is the embeddings' output, normalised already.
        self.attn_norm = nn.Identity() if layer == 0 else ModernBertLayerNorm(config.hidden_size, config.norm_eps,
                                                                               backend)
        self.attn = ModernBertAttention(config, layer, backend)
        self.mlp_norm = ModernBertLayerNorm(config.hidden_size, config.norm_eps, backend)
        self.mlp = ModernBertMLP(config, backend)

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        hidden = hidden + self.attn(self.attn_norm(hidden), rope, cu_seqlens, max_seqlen)
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertModel(nn.Module):
    def __init__(self, config: ModernBertConfig, backend: Backend) -> None:
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config, backend)
        self.layers = nn.ModuleList(ModernBertEncoderLayer(config, i, backend) for i in range(config.num_layers))
        self.final_norm = ModernBertLayerNorm(config.hidden_size, config.norm_eps, backend)
        if config.compile_layers:
            for layer in self.layers:
                layer.compile(dynamic=True)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int) -> torch.Tensor:
        """Packed (T,) inputs -> hidden states (T, H)."""
        hidden = self.embeddings(input_ids)
        c = self.config
        ropes = {theta: rotary_tables(position_ids, c.head_dim, theta, hidden.dtype)
                 for theta in {c.global_rope_theta, c.local_rope_theta}}
        for i, layer in enumerate(self.layers):
            rope = ropes[c.global_rope_theta if c.is_global(i) else c.local_rope_theta]
            # Recomputation only pays off when a backward pass will follow.
            if c.activation_checkpointing and torch.is_grad_enabled():
                hidden = checkpoint(layer, hidden, rope, cu_seqlens, max_seqlen, use_reentrant=False)
            else:
                hidden = layer(hidden, rope, cu_seqlens, max_seqlen)
        return self.final_norm(hidden)


class ModernBertPredictionHead(nn.Module):
    def __init__(self, config: ModernBertConfig, backend: Backend) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.norm = ModernBertLayerNorm(config.hidden_size, config.norm_eps, backend)
        self.approximate = GELU_APPROXIMATE[config.hidden_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, H) -> (M, H)."""
        return self.norm(F.gelu(self.dense(x), approximate=self.approximate))


class ModernBertForPreTraining(nn.Module):
    """The encoder with its masked-LM head, as transformers' ``ModernBertForMaskedLM``."""

    def __init__(self, config: ModernBertConfig, train_seq_len: int | None = None) -> None:
        """``train_seq_len``: the sequence length training feeds, at which ``kernels=auto`` times
        its candidates (default: ``max_position_embeddings``)."""
        super().__init__()
        self.config = config
        self.op_shapes, self.backend = model_backend(  # kernels=auto races its candidates at these shapes
            config, train_seq_len, config.hidden_activation, config.mlp_dropout, window=config.local_window,
            geglu=True, layer_norm_bias=False, rotary=True)
        self.model = ModernBertModel(config, self.backend)
        self.head = ModernBertPredictionHead(config, self.backend)
        self.decoder = MlmDecoder(config.hidden_size, config.vocab_size, device="meta")
        self.decoder.weight = self.model.embeddings.tok_embeddings.weight  # tied
        self.decoder.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """transformers' init: truncated normals (cut at ``initializer_cutoff_factor`` std) of std
        ``initializer_range`` for the embeddings and the input projections, divided by
        sqrt(2 x layers) for the output projections and the head; unit LayerNorms, zero bias."""
        c = self.config
        std_in, std_out = c.initializer_range, c.initializer_range / math.sqrt(2.0 * c.num_layers)

        def normal(weight: torch.Tensor, std: float) -> None:
            nn.init.trunc_normal_(weight, 0.0, std, -c.initializer_cutoff_factor * std, c.initializer_cutoff_factor * std)

        normal(self.model.embeddings.tok_embeddings.weight, std_in)
        self.model.embeddings.tok_embeddings.weight[c.pad_token_id].zero_()
        for layer in self.model.layers:
            normal(layer.attn.Wqkv.weight, std_in)
            normal(layer.attn.Wo.weight, std_out)
            normal(layer.mlp.Wi.weight, std_in)
            normal(layer.mlp.Wo.weight, std_out)
        normal(self.head.dense.weight, std_out)
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
        self.decoder.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        masked_lm_labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        unpadded: Unpadded | None = None,
    ) -> PreTrainingOutput:
        """input_ids: (B, S) int64, padding on the right. The layout comes as ``unpadded``
        (training: the loader's, computed on the host) or from ``attention_mask`` (B, S) with
        ``masked_lm_labels`` (B, S), as for BERT (:meth:`bert_ds.model.bert.model.BertForPreTraining.forward`).
        ``token_type_ids`` are the shared batch layout's segment ids, unused here (no segment
        embeddings); a ``next_sentence_label`` is refused (no sentence-pair head)."""
        if next_sentence_label is not None:
            raise ValueError("a ModernBERT-class model has no next-sentence head: train it with --pair-task none")
        unpadded, position_ids = input_layout(input_ids, attention_mask, masked_lm_labels, unpadded,
                                              self.config.max_position_embeddings)  # each sequence from 0
        hidden = self.model(gather_tokens(input_ids, unpadded.token_indices), position_ids, unpadded.cu_seqlens,
                            unpadded.max_seqlen)  # (T, H)
        labels = unpadded.masked_labels  # (M,) or None
        predicted = hidden if labels is None else hidden.index_select(0, unpadded.masked_positions)  # (M, H)
        logits = self.decoder(self.head(predicted))  # (M, V')
        out = PreTrainingOutput(mlm_logits=vocab_columns(logits, self.config.vocab_size))
        if labels is not None:
            masked_lm(out, logits, labels, self.backend)
        return out
