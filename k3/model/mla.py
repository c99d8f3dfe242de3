"""Gated Multi-head Latent Attention with NoPE (docs/architecture.md §3; K3 report §2.1.2).

Legend: B batch, T new tokens, S attended tokens (cached + new), D model width, H heads,
N = qk_nope_head_dim, R = qk_rope_head_dim (never rotated: NoPE), Vd = v_head_dim, C = kv_lora_rank.

Two ways to compute the same attention, chosen by `config.mla_impl`:
- `naive`: expand the latent into per-head keys and values with kv_b_proj (training, prefill);
- `absorb`: fold W_UK into the query and attend in latent space, MQA-style, with 576-wide keys and
  512-wide values, then apply W_UV per head (decode: the cache is read once, never expanded).
W_UV cannot be folded into o_proj, because the sigmoid output gate sits between them.
`auto` uses naive for multi-token calls and absorb for single-token decode steps.
Scores and softmax are fp32; the output is cast once.

Training and prefill (the expanded path) run on a fast attention backend (`config.attention_backend`,
k3.ops.attention: FlashAttention varlen, flex_attention with a document block mask, or SDPA; "auto" =
flash/flex on CUDA, the reference elsewhere), with the mask of packed documents; the kernels accumulate
in fp32. `attend` with an explicit mask stays the reference; on the reference backend packed documents go
through `attend_documents` (the same attention one document at a time). The decode (absorb) and ragged
incremental paths are unchanged. `attention` is the seam for context parallelism: queries at absolute
positions offset + t with their document ids against any key latent with its own document ids.
"""

from __future__ import annotations

import torch
from torch import nn

from k3.config import ModelConfig
from k3.model.cache import MLALatent, PagedMLALatent
from k3.model.norm import RMSNorm
from k3.model.sequence import SequenceLayout
from k3.ops import triton_runs_on
from k3.ops.attention import document_attention, document_mask, resolve_backend
from k3.ops.mla_decode import kernel_supports, paged_latent_attention, paged_latent_attention_reference
from k3.ops.mla_keys import expand_keys, expand_keys_available, naive_expand_keys


def attention_mask(layout: SequenceLayout, T: int, offset: int, device) -> torch.Tensor:
    """[B or 1, T, offset + T] bool: causal over absolute positions, and within one document when packed."""
    q_pos = torch.arange(T, device=device) + offset
    k_pos = torch.arange(offset + T, device=device)
    mask = (k_pos[None, :] <= q_pos[:, None]).unsqueeze(0)  # [1, T, S]
    if layout.segment_ids is not None:
        seg = layout.segment_ids
        mask = mask & (seg[:, :, None] == seg[:, None, :])  # [B, T, T]
    return mask


class GatedMLA(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.impl = config.mla_impl
        self.backend = config.attention_backend
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        # NoPE: the 64 "rope" channels are kept but never rotated, so the scale covers all 192 dims
        self.softmax_scale = (self.nope_dim + self.rope_dim) ** -0.5
        self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, H * (self.nope_dim + self.rope_dim), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)

    def latent(self, x: torch.Tensor) -> torch.Tensor:
        """The cached quantity: [ĉ ; k_pe] = [RMSNorm(c) ; k_pe], [B, T, C + R]."""
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)

    def forward(self, x: torch.Tensor, layout: SequenceLayout, state: MLALatent | None = None,
                use_cache: bool = False, impl: str | None = None,
                max_logits: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, MLALatent | None]:
        """x [B, T, D] (already input_layernorm'ed). Returns (y [B, T, D], the grown latent cache or None).

        Ragged incremental mode (the inference engine's): `layout.past_lengths` set, B = 1, documents of
        `layout.cu_seqlens` continue the cache's sequences, whose latents are rows of `state.latent`
        (padded; row n valid up to past_lengths[n]).
        If `max_logits` is a list, the per-head max of the scaled logits over unmasked pairs ([H] fp32,
        for QK-Clip) is appended to it.
        """
        if isinstance(state, PagedMLALatent):
            return self.paged_decode(x, state), state
        B, T, _ = x.shape
        H = self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, H, -1)  # [B, T, H, N + R]
        new_latent = self.latent(x)  # [B, T, C + R]
        impl = impl or self.impl
        if layout.packed and use_cache and layout.past_lengths is None:
            raise ValueError("packed sequences build a cache only in ragged mode (layout.past_lengths)")
        if layout.past_lengths is not None:
            o, grown = self._ragged(q, new_latent, layout, state, impl)
        else:
            if state is not None:
                offset = state.latent.shape[1]
                latent = torch.cat([state.latent, new_latent.to(state.latent.dtype)], dim=1)  # [B, S, C + R]
            else:
                offset, latent = 0, new_latent
            expanded = impl == "naive" or (impl == "auto" and T > 1)
            backend = resolve_backend(self.backend, x.device)
            if backend == "flex" and (use_cache or state is not None):
                # prefill lengths vary call to call: SDPA needs no compilation per length
                backend = "sdpa"
            if expanded and backend != "reference":
                # packed documents come only without a cache (checked above): the same ids on both sides
                seg = layout.segment_ids
                o = self.attention(q, latent, offset, seg, seg, max_logits, backend)
            elif layout.packed:
                # packed documents (no cache, so offset 0): one document at a time, not the (B·T)² mask
                o = self.attend_documents(q, latent, layout.host_offsets(), impl, max_logits)
            else:
                mask = attention_mask(layout, T, offset, x.device)
                o = self.attend(q, latent, mask, impl, max_logits)
            grown = latent
        o = o.reshape(B, T, H * self.v_dim).to(x.dtype)
        y = self.o_proj(torch.sigmoid(self.g_proj(x)) * o)
        return y, (MLALatent(grown) if use_cache else None)

    def _ragged(self, q, new_latent, layout, state, impl):
        """Each document attends to its own sequence's past latents plus its new ones (causal)."""
        cu = layout.host_offsets()
        past = layout.past_lengths
        # prefill chunks go through the training attention backend (SDPA: lengths vary call to call, so flex
        # would compile per length); single tokens and CPU stay on the reference
        backend = resolve_backend(self.backend, q.device)
        backend = "sdpa" if backend == "flex" else backend
        outs, rows = [], []
        for n, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            old = state.latent[n, : past[n]] if state is not None else new_latent.new_zeros(0, new_latent.shape[-1])
            latent = torch.cat([old, new_latent[0, a:b].to(old.dtype)])[None]  # [1, S_n, C + R]
            rows.append(latent[0])
            if b - a > 1 and backend != "reference" and impl != "absorb":
                outs.append(self.attention(q[:, a:b], latent, past[n], None, None, None, backend).float())
            elif b > a:
                mask = attention_mask(SequenceLayout(1, b - a), b - a, past[n], q.device)
                outs.append(self.attend(q[:, a:b], latent, mask, impl, None))
        S = max(r.shape[0] for r in rows)
        grown = new_latent.new_zeros(len(rows), S, new_latent.shape[-1], dtype=rows[0].dtype)
        for n, r in enumerate(rows):
            grown[n, : r.shape[0]] = r
        return torch.cat(outs, dim=1), grown

    def expand_latent(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [B, S, C + R] -> per-head keys [B, S, H, N + R] (k_pe shared, unrotated), values [B, S, H, Vd]."""
        B, S, _ = latent.shape
        H = self.num_heads
        c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(c).view(B, S, H, self.nope_dim + self.v_dim)  # [B, S, H, N + Vd]
        if expand_keys_available(kv):
            return expand_keys(kv, k_pe, self.nope_dim)  # one Triton pass each way instead of strided cats
        return naive_expand_keys(kv, k_pe, self.nope_dim)

    def attention(self, q: torch.Tensor, latent: torch.Tensor, offset: int, q_doc: torch.Tensor | None,
                  kv_doc: torch.Tensor | None, max_logits: list[torch.Tensor] | None = None,
                  backend: str | None = None) -> torch.Tensor:
        """Expanded attention of queries at absolute positions offset + arange(T) against the keys of
        `latent` at positions arange(S); query t sees key s iff s ≤ offset + t and, when ids are given,
        q_doc[b, t] == kv_doc[b, s].

        q [B, T, H, N + R]; latent [B, S, C + R]; q_doc [B, T], kv_doc [B, S] int or both None.
        Returns o [B, T, H, Vd] (the backend's dtype; fp32 for the reference). Appends the per-head max
        logit [H] fp32 to `max_logits` when it is a list.
        """
        B, T, H, _ = q.shape
        S = latent.shape[1]
        backend = resolve_backend(backend or self.backend, q.device)
        if backend == "reference":
            mask = document_mask(T, S, offset, q_doc, kv_doc, q.device)
            return self.attend(q, latent, mask, "naive", max_logits)
        k, v = self.expand_latent(latent)
        o, ml = document_attention(q.to(k.dtype), k, v, self.softmax_scale, offset, q_doc, kv_doc, backend,
                                   want_max=max_logits is not None)
        if max_logits is not None:
            max_logits.append(ml)
        return o

    def attend_documents(self, q: torch.Tensor, latent: torch.Tensor, offsets: list[int], impl: str,
                         max_logits: list[torch.Tensor] | None) -> torch.Tensor:
        """`attend` over packed documents one at a time, each causal within itself: the result of `attend` with
        the block-diagonal `attention_mask` (tested to fp64 rounding), at Σ L_n² score entries instead of B·T²,
        the reference backend's path for packed rows (SFT and RL batches hold many short documents).
        q [B, T, H, N + R]; latent [B, T, C + R]; offsets: the N + 1 document bounds into B·T (host ints).
        """
        B, T, H, _ = q.shape
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        # split once (its backward is one concatenation; slicing per document would fill a full-size gradient each)
        q_docs = q.reshape(1, B * T, H, -1).split(lengths, dim=1)
        latent_docs = latent.reshape(1, B * T, -1).split(lengths, dim=1)
        outs, doc_max = [], [] if max_logits is not None else None
        for L, q_n, latent_n in zip(lengths, q_docs, latent_docs):
            if L:
                causal = torch.ones(1, L, L, dtype=torch.bool, device=q.device).tril()
                outs.append(self.attend(q_n, latent_n, causal, impl, doc_max))
        if max_logits is not None:
            max_logits.append(torch.stack(doc_max).amax(0))
        return torch.cat(outs, 1).view(B, T, H, -1)  # [B, T, H, Vd]

    def attend(self, q: torch.Tensor, latent: torch.Tensor, mask: torch.Tensor, impl: str,
               max_logits: list[torch.Tensor] | None) -> torch.Tensor:
        """q [B, T, H, N + R]; latent [B, S, C + R]; mask [B or 1, T, S] -> o [B, T, H, Vd] (fp32)."""
        B, T, H, _ = q.shape
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = latent.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if impl == "auto":
            impl = "absorb" if T == 1 else "naive"
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        w_kv = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)  # [H, N, C], [H, Vd, C]
        if impl == "naive":
            kv = self.kv_b_proj(c).view(B, -1, H, self.nope_dim + self.v_dim)  # [B, S, H, N + Vd]
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            scores = torch.einsum("bthn,bshn->bhts", q_nope.to(compute), k_nope.to(compute))
        elif impl == "absorb":
            q_lat = torch.einsum("bthn,hnc->bthc", q_nope.to(compute), w_uk.to(compute))  # [B, T, H, C]
            scores = torch.einsum("bthc,bsc->bhts", q_lat, c.to(compute))
        else:
            raise ValueError(f"mla impl must be naive|absorb|auto, got {impl!r}")
        scores = scores + torch.einsum("bthr,bsr->bhts", q_pe.to(compute), k_pe.to(compute))
        scores = scores * self.softmax_scale  # [B, H, T, S]
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        if max_logits is not None:
            max_logits.append(scores.detach().amax(dim=(0, 2, 3)).float())
        probs = torch.softmax(scores, dim=-1)
        if impl == "naive":
            return torch.einsum("bhts,bshv->bthv", probs, v.to(compute))  # [B, T, H, Vd]
        o_lat = torch.einsum("bhts,bsc->bthc", probs, c.to(compute))  # [B, T, H, C]
        return torch.einsum("bthc,hvc->bthv", o_lat, w_uv.to(compute))  # [B, T, H, Vd]

    def paged_decode(self, x: torch.Tensor, state: PagedMLALatent) -> torch.Tensor:
        """One token per row (x [B, 1, D]) against latents kept in place in pages: the engine's decode step.

        Writes the new latent at row lengths[b] of its page, then attends in absorbed form over rows
        0 … lengths[b] (the paged kernel on CUDA, `paged_latent_attention_reference` elsewhere). Same math as
        `attend(..., "absorb")`: fp32 scores and softmax, W_UK folded into the query, W_UV applied after.
        """
        B = x.shape[0]
        H, C = self.num_heads, self.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, H, -1)  # [B, H, N + R]
        pages, table, lengths = state.pages, state.block_table, state.lengths
        pt = pages.shape[1]
        page = table.gather(1, (lengths // pt).long()[:, None])[:, 0].long()
        pages[page, (lengths % pt).long()] = self.latent(x)[:, 0].to(pages.dtype)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        w_kv = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, C)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)  # [H, N, C], [H, Vd, C]
        q_lat = torch.einsum("bhn,hnc->bhc", q_nope.to(compute), w_uk.to(compute))
        q_full = torch.cat([q_lat, q_pe.to(compute)], dim=-1)  # [B, H, C + R]
        fused = triton_runs_on(q) and compute == torch.float32 and kernel_supports(C, self.rope_dim, pt)
        attend = paged_latent_attention if fused else paged_latent_attention_reference
        o_lat = attend(q_full, pages, table, lengths + 1, self.softmax_scale, C)  # [B, H, C]
        o = torch.einsum("bhc,hvc->bhv", o_lat, w_uv.to(compute)).reshape(B, 1, H * self.v_dim).to(x.dtype)
        return self.o_proj(torch.sigmoid(self.g_proj(x)) * o)
