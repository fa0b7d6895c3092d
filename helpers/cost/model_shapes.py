"""A transformer's shape, and what it costs per token: parameters and FLOPs, pure arithmetic.

Notebook 10 plans real runs with these records. Each counts the weight matrices (biases and
norms are left out: under 0.1 % of every model here) and one convention for FLOPs, stated
once: a token costs 6 FLOP per active weight (forward 2, backward 4; the logits' matrix
included, the embedding lookup not) plus attention's two matmuls over the sequence,
6·s·a·(d_qk + d_v) per layer, counted in full whatever the causal mask skips: with
d_qk = d_v = h/a that is 12·s·h per layer. That is PaLM's convention
(Chowdhery et al. 2022, appendix B: 6N + 12·L·H·Q·T) and Megatron-LM's (Narayanan et al. 2021,
eq. 3, before its factor 4/3 for recomputation): `model_flops_per_token`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from helpers.checks import check_int


@dataclass(frozen=True)
class Transformer:
    """A decoder: L layers of width h with a heads (kv_heads of them for keys and values),
    a dense MLP of width `ffn` (three matrices when `gated`, SwiGLU; two otherwise), a
    vocabulary V. A mixture of experts replaces the MLP of all but `dense_layers` layers by
    `experts` routed experts of width `expert_ffn` (top_k per token) plus `shared_experts`."""
    name: str
    layers: int           # L
    hidden: int           # h
    heads: int            # a
    ffn: int              # the dense MLP's width
    vocab: int            # V
    kv_heads: int = 0     # 0: as many as heads (multi-head attention)
    gated: bool = False
    experts: int = 0      # routed experts per MoE layer; 0: dense
    top_k: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # an MoE model's first layers keep a dense MLP (DeepSeek-V3: 3)
    head_dim_qk: int = 0   # 0: h / a
    head_dim_v: int = 0
    attention_weights: int = 0  # per layer, when not 2·h·(a + kv)·d_head (MLA's low-rank form)
    tied_embeddings: bool = False
    source: str = ""

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "ffn", "vocab"):
            check_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise ValueError(f"{self.name}: hidden={self.hidden} must be a multiple of "
                             f"heads={self.heads}")
        for name in ("kv_heads", "experts", "top_k", "expert_ffn", "shared_experts",
                     "dense_layers", "head_dim_qk", "head_dim_v", "attention_weights"):
            check_int(name, getattr(self, name), low=0)
        if self.kv_heads and self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: kv_heads={self.kv_heads} must divide "
                             f"heads={self.heads}")
        if self.experts and not (1 <= self.top_k <= self.experts and self.expert_ffn >= 1
                                 and self.dense_layers < self.layers):
            raise ValueError(f"{self.name}: an MoE needs 1 <= top_k <= experts "
                             f"({self.top_k} of {self.experts}), expert_ffn >= 1 "
                             f"({self.expert_ffn}) and dense_layers < layers "
                             f"({self.dense_layers} of {self.layers})")

    # --- shape -------------------------------------------------------------------------
    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_qk(self) -> int:
        return self.head_dim_qk or self.hidden // self.heads

    @property
    def d_v(self) -> int:
        return self.head_dim_v or self.hidden // self.heads

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    # --- weights -------------------------------------------------------------------------
    @property
    def matrices(self) -> int:
        """Weight matrices per MLP (or expert): 3 with a gate, else 2."""
        return 3 if self.gated else 2

    @cache  # a frozen record: its counts never change
    def attention_params(self) -> int:
        """Q, K, V and the output projection of one layer."""
        if self.attention_weights:
            return self.attention_weights
        h = self.hidden
        return h * self.heads * self.d_qk + h * self.kv * (self.d_qk + self.d_v) \
            + self.heads * self.d_v * h

    def mlp_params(self, width: int) -> int:
        return self.matrices * self.hidden * width

    @cache  # a frozen record: its counts never change
    def routed_params(self) -> int:
        """Every routed expert of every MoE layer: the part expert parallelism divides."""
        return self.moe_layers * self.experts * self.mlp_params(self.expert_ffn)

    @cache  # a frozen record: its counts never change
    def dense_params(self) -> int:
        """Layer weights that every expert-parallel rank keeps: attention, dense MLPs,
        shared experts."""
        dense_mlp = (self.layers - self.moe_layers) * self.mlp_params(self.ffn)
        shared = self.moe_layers * self.shared_experts * self.mlp_params(self.expert_ffn)
        return self.layers * self.attention_params() + dense_mlp + shared

    def embedding_params(self) -> int:
        """Input embedding and output head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @cache  # a frozen record: its counts never change
    def params(self) -> int:
        return self.dense_params() + self.routed_params() + self.embedding_params()

    @cache  # a frozen record: its counts never change
    def active_params(self) -> int:
        """Weights one token meets: the dense ones, top_k experts per MoE layer, both
        embeddings' matrices (the lookup does no FLOPs, see model_flops_per_token)."""
        routed = self.moe_layers * self.top_k * self.mlp_params(self.expert_ffn)
        return self.dense_params() + routed + self.embedding_params()

    # --- FLOPs ---------------------------------------------------------------------------
    def attention_flops_per_token(self, seq: int) -> float:
        """Forward and backward of the scores (QKᵀ) and of their product with V, per token,
        over the whole sequence (no causal halving): 6·s·a·(d_qk + d_v) per layer."""
        check_int("seq", seq)
        return self.layers * 6 * seq * self.heads * (self.d_qk + self.d_v)

    def model_flops_per_token(self, seq: int) -> float:
        """6 FLOP per active matmul weight (the input embedding is a lookup: left out) plus
        attention: the numerator of MFU everywhere in notebook 10."""
        logits = self.vocab * self.hidden       # the output head's matmul, tied or not
        return (6 * (self.active_params() - self.embedding_params() + logits)
                + self.attention_flops_per_token(seq))


def _mla_weights(h: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int,
                 v: int) -> int:
    """DeepSeek's multi-head latent attention per layer (arXiv:2412.19437 §2.1.1): queries
    and keys-values through low-rank latents, plus the decoupled rotary key."""
    return (h * q_rank + q_rank * heads * (nope + rope)      # W_DQ, W_UQ (with W_QR)
            + h * (kv_rank + rope)                            # W_DKV, W_KR
            + kv_rank * heads * (nope + v)                    # W_UK, W_UV
            + heads * v * h)                                  # W_O


GPT3_175B = Transformer("GPT-3 175B", 96, 12288, 96, 4 * 12288, 51200, tied_embeddings=True,
                        source="Brown et al. 2020, Table 2.1; vocabulary padded to 51,200 and "
                               "the output head tied to the embedding, as Megatron-LM trains it")
LLAMA3_8B = Transformer("Llama 3 8B", 32, 4096, 32, 14336, 128256, kv_heads=8, gated=True,
                        source="Dubey et al. 2024 (arXiv:2407.21783), Table 3")
LLAMA3_70B = Transformer("Llama 3 70B", 80, 8192, 64, 28672, 128256, kv_heads=8, gated=True,
                         source="Dubey et al. 2024 (arXiv:2407.21783), Table 3")
LLAMA3_405B = Transformer("Llama 3 405B", 126, 16384, 128, 53248, 128256, kv_heads=8,
                          gated=True, source="Dubey et al. 2024 (arXiv:2407.21783), Table 3")
DEEPSEEK_V3 = Transformer(
    "DeepSeek-V3", 61, 7168, 128, 18432, 129280, gated=True, experts=256, top_k=8,
    expert_ffn=2048, shared_experts=1, dense_layers=3, head_dim_qk=192, head_dim_v=128,
    attention_weights=_mla_weights(7168, 128, 1536, 512, 128, 64, 128),
    source="DeepSeek-AI 2024 (arXiv:2412.19437), §4.2 (hyper-parameters); the multi-token "
           "prediction module left out, as the report's 671B does")

MODELS: dict[str, Transformer] = {m.name: m for m in (
    LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, GPT3_175B, DEEPSEEK_V3)}
