"""The Transformer (§3) as three models: encoder-decoder, decoder-only LM, encoder classifier."""

from __future__ import annotations

import math

import torch
from torch import nn

from aiayn.config import ModelConfig
from aiayn.model.attention import CrossAttention, KVCache, SelfAttention
from aiayn.model.dropout import Dropout
from aiayn.model.layers import DecoderLayer, EncoderLayer
from aiayn.model.masks import padding_mask, self_attention_mask
from aiayn.model.positions import make_positions


class Embeddings(nn.Module):
    """Token embedding times sqrt(d_model) (§3.4), plus positions (§3.5), then dropout (§5.4)."""

    def __init__(self, vocab_size: int, cfg: ModelConfig, token: nn.Embedding | None = None):
        super().__init__()
        self.token = token if token is not None else nn.Embedding(vocab_size, cfg.d_model)
        self.positions = make_positions(cfg.positions, cfg.d_model, cfg.max_len)
        self.dropout = Dropout(cfg.dropout)
        self.scale = math.sqrt(cfg.d_model)

    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        x = self.token(tokens) * self.scale  # (B, T, D)
        # In the embedding's dtype: DeepSpeed's fp16 casts the parameters to half and keeps
        # buffers (the sinusoids) in fp32, which would promote the sum, and every layer's
        # input, back to fp32.
        x = x + self.positions(tokens.size(1), start).to(x.dtype)  # (B, T, D) + (T, D)
        return self.dropout(x)


def _final_norm(cfg: ModelConfig) -> nn.Module:
    # Pre-LN leaves the residual stream unnormalised, so the stack ends in a LayerNorm;
    # post-LN layers already end in one.
    return nn.LayerNorm(cfg.d_model) if cfg.norm == "pre" else nn.Identity()


def _project(out: nn.Linear, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """The pre-softmax projection of decoder states x (B, T, D): logits (B, T, V), or (N, V) at
    the N flat positions keep (N,) int64 of x's B * T rows (Batch.keep). Training passes the
    non-pad targets, so the largest matrix multiply of a small model and the loss after it skip
    padding. Positions rather than a boolean mask: on a GPU, indexing by a mask waits for the
    device to count it, a host sync in every forward; the loader counts on the host."""
    if keep is not None:
        x = x.flatten(0, 1).index_select(0, keep)  # (N, D)
    return out(x)


class Encoder(nn.Module):
    """N identical layers of self-attention and FFN (§3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.N))
        self.norm = _final_norm(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)  # (B, S, D)
        return self.norm(x)


class DecoderState:
    """What incremental decoding carries from step to step: every layer's keys and values, and
    how many target positions have been fed. Made empty; the decoder fills it on first use."""

    def __init__(self):
        self.self_attn: list[KVCache] = []
        self.cross_attn: list[KVCache] = []
        self.length = 0

    def reorder(self, index: torch.Tensor) -> None:
        """Keep rows `index` (B',) of the self-attention caches, e.g. the hypotheses that survive
        a beam-search step. The cross-attention caches are left alone (see select_sources)."""
        for cache in self.self_attn:
            cache.reorder(index)

    def select_sources(self, index: torch.Tensor) -> None:
        """Keep rows `index` of the cross-attention caches: the source sentences still decoded.

        The cross-attention caches hold one row per source sentence; the decoder may have G
        rows per sentence (row b * G + g belongs to sentence b, see CrossAttention), so a
        reorder within each sentence's rows leaves them as they are.
        """
        for cache in self.cross_attn:
            cache.reorder(index)


class Decoder(nn.Module):
    """decoder_layers (default N) layers of masked self-attention, cross-attention and FFN."""

    def __init__(self, cfg: ModelConfig, cross: bool = True):
        super().__init__()
        n = cfg.decoder_layers or cfg.N
        self.layers = nn.ModuleList(DecoderLayer(cfg, cross) for _ in range(n))
        self.norm = _final_norm(cfg)

    def forward(
        self,
        x: torch.Tensor,
        self_mask: torch.Tensor | None,
        is_causal: bool,
        memory: torch.Tensor | None = None,
        src_mask: torch.Tensor | None = None,
        state: DecoderState | None = None,
    ) -> torch.Tensor:
        if state is not None and not state.self_attn:
            state.self_attn = [KVCache() for _ in self.layers]
            state.cross_attn = [KVCache() for _ in self.layers]
        for i, layer in enumerate(self.layers):
            caches = (
                (state.self_attn[i], state.cross_attn[i]) if state is not None else (None, None)
            )
            x = layer(x, self_mask, is_causal, memory, src_mask, *caches)
        return self.norm(x)


class Seq2SeqTransformer(nn.Module):
    """Encoder-decoder for translation (§3, Figure 1)."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int):
        super().__init__()
        self.cfg, self.pad_id = cfg, pad_id
        self.src_embed = Embeddings(vocab_size, cfg)
        # share_embeddings=all: one matrix for both languages and the output (§3.4).
        shared = self.src_embed.token if cfg.share_embeddings == "all" else None
        self.tgt_embed = Embeddings(vocab_size, cfg, token=shared)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg, cross=True)
        # The pre-softmax projection; its bias (model.output_bias) is Marian's final_logits_bias.
        self.out = nn.Linear(cfg.d_model, vocab_size, bias=cfg.output_bias)
        if cfg.share_embeddings in ("all", "decoder"):
            self.out.weight = self.tgt_embed.token.weight
        init_parameters(self, cfg.d_model)

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) -> memory (B, S, D) and src_mask (B, 1, 1, S), True at real tokens."""
        src_mask = padding_mask(src, self.pad_id)
        return self.encoder(self.src_embed(src), src_mask), src_mask

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        state: DecoderState | None = None,
        right_padded: bool = True,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tgt (B, T) -> logits (B, T, V). With a state, tgt holds only the new positions, which
        follow the state.length already fed; the state is updated in place. right_padded=False
        if tgt has padding before real tokens (see masks.self_attention_mask). With keep
        (N,), logits (N, V) at those flat positions of (B * T) only (see _project)."""
        start = state.length if state is not None else 0
        self_mask, is_causal = self_attention_mask(tgt, self.pad_id, start, right_padded)
        x = self.tgt_embed(tgt, start)  # (B, T, D)
        x = self.decoder(x, self_mask, is_causal, memory, src_mask, state)  # (B, T, D)
        if state is not None:
            state.length += tgt.size(1)
        return _project(self.out, x, keep)

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        right_padded: bool = True,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """src (B, S), tgt_in (B, T) -> logits (B, T, V) predicting tgt_out, or (N, V) at the
        flat positions `keep` (N,) of (B * T). Source padding may be anywhere; target padding
        trailing unless right_padded=False."""
        memory, src_mask = self.encode(src)
        return self.decode(tgt_in, memory, src_mask, right_padded=right_padded, keep=keep)


class DecoderOnlyLM(nn.Module):
    """The decoder alone, without cross-attention: a causal language model."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int):
        super().__init__()
        self.cfg, self.pad_id = cfg, pad_id
        self.embed = Embeddings(vocab_size, cfg)
        self.decoder = Decoder(cfg, cross=False)
        self.out = nn.Linear(cfg.d_model, vocab_size, bias=cfg.output_bias)
        if cfg.share_embeddings != "none":  # an LM has no source side: all means decoder
            self.out.weight = self.embed.token.weight
        init_parameters(self, cfg.d_model)

    def forward(
        self,
        tokens: torch.Tensor,
        state: DecoderState | None = None,
        right_padded: bool = True,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, V), or (N, V) at the flat positions `keep` (N,).
        With a state, tokens are the new positions only. Padding trailing unless
        right_padded=False (see masks.self_attention_mask)."""
        start = state.length if state is not None else 0
        mask, is_causal = self_attention_mask(tokens, self.pad_id, start, right_padded)
        x = self.decoder(self.embed(tokens, start), mask, is_causal, state=state)  # (B, T, D)
        if state is not None:
            state.length += tokens.size(1)
        return _project(self.out, x, keep)


class EncoderClassifier(nn.Module):
    """The encoder, pooled over positions, then a small head: one label per sequence."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int):
        super().__init__()
        self.cfg, self.pad_id = cfg, pad_id
        self.embed = Embeddings(vocab_size, cfg)
        self.encoder = Encoder(cfg)
        self.head = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_model),
            nn.Tanh(),
            Dropout(cfg.dropout),
            nn.Linear(cfg.d_model, cfg.num_classes),
        )
        init_parameters(self, cfg.d_model)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        """src (B, S) -> logits (B, num_classes)."""
        mask = padding_mask(src, self.pad_id)  # (B, 1, 1, S)
        x = self.encoder(self.embed(src), mask)  # (B, S, D)
        if self.cfg.pooling == "first":
            pooled = x[:, 0]  # (B, D)
        else:
            keep = (src != self.pad_id).unsqueeze(-1).to(x.dtype)  # (B, S, 1)
            pooled = (x * keep).sum(1) / keep.sum(1).clamp(min=1)  # (B, D)
        return self.head(pooled)  # (B, C)


def vocab_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters with one row per vocabulary entry: each token embedding and the output
    projection, a tied matrix once."""
    params = [m.token.weight for m in model.modules() if isinstance(m, Embeddings)]
    out = getattr(model, "out", None)
    if isinstance(out, nn.Linear):
        params.append(out.weight)
    return list({id(p): p for p in params}.values())


def init_parameters(model: nn.Module, d_model: int) -> None:
    """Xavier-uniform Linear weights, zero biases, embeddings N(0, d_model^-0.5).

    With the sqrt(d_model) scaling of §3.4 the embedded inputs then have unit scale. Embeddings
    go last so that an output projection tied to them keeps the embedding init.
    """
    modules = list(model.modules())
    for m in modules:
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    for m in modules:
        if isinstance(m, (SelfAttention, CrossAttention)):
            m.reset_fused()
    for m in modules:
        if isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=d_model**-0.5)


_MODELS = {"seq2seq": Seq2SeqTransformer, "lm": DecoderOnlyLM, "classifier": EncoderClassifier}


def build_model(cfg: ModelConfig, vocab_size: int, pad_id: int) -> nn.Module:
    """The model of kind cfg.kind, initialised. Presets must already be applied to cfg."""
    return _MODELS[cfg.kind](cfg, vocab_size, pad_id)


def count_parameters(model: nn.Module) -> int:
    """Unique parameters: a matrix tied in several places counts once."""
    return sum(p.numel() for p in model.parameters())  # parameters() yields each tensor once
