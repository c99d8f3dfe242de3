"""The K3 text stack: decoder layers, Block AttnRes wiring, head (docs/architecture.md §1, §4.2).

Legend: B batch, T tokens, D model width, V vocabulary.

    ids → embed_tokens → L × DecoderLayer → output AttnRes read → norm → lm_head → logits
    DecoderLayer ℓ: a = AR_attn(blocks) → y = Mixer_ℓ(input_layernorm a)       (KDA or Gated MLA)
                    m = AR_mlp(blocks)  → z = FFN_ℓ(post_attention_layernorm m) (dense at ℓ=0, else MoE)
                    y and z are summed into the current AttnRes block

One forward serves training (packed rows with `cu_seqlens`), prefill and incremental decoding (with a
`K3Cache`). Each decoder layer's step of the direct wiring is its `forward`, so a transform such as
`k3.model.checkpointing.apply_activation_checkpointing` can wrap it without touching this file. Parameter names follow the release's text stack without the `language_model.` prefix,
except the routed experts, which are stacked per kind (`experts.w1` [E, I, L]); `k3.convert` maps them.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from k3.config import ModelConfig
from k3.model.attn_res import (block_reads, fused_two_phase_available, plain_residual_read, pseudo_query, seal,
                               select_read)
from k3.model.cache import K3Cache
from k3.model.kda import KimiDeltaAttention
from k3.model.mla import GatedMLA
from k3.model.moe import LatentExperts, RouterInfo, SiTUMLP, StableLatentMoE
from k3.model.norm import RMSNorm
from k3.model.sequence import SequenceLayout, to_device_without_waiting
from k3.ops.cross_entropy import linear_cross_entropy


class Collector:
    """Where layers append side outputs (router statistics, MLA max logits) during one forward.

    Deliberately not a list: wrappers that map over a module's arguments (FSDP2 moving inputs to the
    device, casting them) rebuild lists and tuples, and appends to a rebuilt copy would be lost.
    """

    def __init__(self):
        self._items: list = []

    def append(self, item) -> None:
        self._items.append(item)

    def extend(self, items) -> None:
        self._items.extend(items)

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class K3Output:
    logits: torch.Tensor | None  # [B, T, V]; None when the forward was given labels
    cache: K3Cache | None = None
    router_infos: list[RouterInfo] | None = None  # one per MoE layer, in layer order
    mla_max_logits: torch.Tensor | None = None  # [num MLA layers, H] fp32, for QK-Clip
    loss: torch.Tensor | None = None  # with labels: Σ token cross-entropy over labelled tokens (fp32)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_kda = config.is_kda_layer(layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        # AttnRes pseudo-queries, stored factorised as in the release: w = res_norm.weight ⊙ res_proj.weight[0]
        self.self_attention_res_norm = RMSNorm(D, eps)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
        self.mlp_res_norm = RMSNorm(D, eps)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False)
        self.self_attn = KimiDeltaAttention(config, layer_idx) if self.is_kda else GatedMLA(config, layer_idx)
        if self.is_moe:
            self.block_sparse_moe = StableLatentMoE(config)
        else:
            self.mlp = SiTUMLP(D, config.intermediate_size, config.activation_situ_beta,
                               config.activation_situ_linear_beta, config.situ_impl, config.hidden_act)
        self.attn_res_block_size = config.attn_res_block_size

    def attn_query(self) -> torch.Tensor:
        return pseudo_query(self.self_attention_res_norm.weight, self.self_attention_res_proj.weight)

    def mlp_query(self) -> torch.Tensor:
        return pseudo_query(self.mlp_res_norm.weight, self.mlp_res_proj.weight)

    def mixer(self, a, layout, state, use_cache, mla_max_logits):
        x = self.input_layernorm(a)
        if self.is_kda:
            return self.self_attn(x, layout, state, use_cache)
        return self.self_attn(x, layout, state, use_cache, max_logits=mla_max_logits)

    def ffn(self, m, router_infos):
        x = self.post_attention_layernorm(m)
        if self.is_moe:
            return self.block_sparse_moe(x, router_infos)
        return self.mlp(x)

    def run_mixer(self, a, layout, cache, mla_max_logits):
        state = cache.layers[self.layer_idx] if cache is not None else None
        y, new_state = self.mixer(a, layout, state, cache is not None, mla_max_logits)
        if cache is not None:
            cache.layers[self.layer_idx] = new_state
        return y

    def forward(self, sealed: list[torch.Tensor], partial: torch.Tensor, layout: SequenceLayout,
                cache: K3Cache | None = None, router_infos: list | None = None,
                mla_max_logits: list | None = None, read=None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """One layer of the direct AttnRes wiring (docs/architecture.md §4.2): (sealed, partial) -> (sealed, partial).

        `read(w, sources)` is the AttnRes read (reference or fused); `sealed` is returned as a new list.
        """
        read = read or select_read("direct", partial)
        a = partial if not sealed else read(self.attn_query(), sealed + [partial])
        if self.layer_idx % self.attn_res_block_size == 0:
            # seal before the mixer runs: the finished block (or the embedding) becomes a source
            sealed = sealed + [seal(partial, read)]
            partial = None
        y = self.run_mixer(a, layout, cache, mla_max_logits)
        # a block's first output starts its partial sum in the stream's dtype (the embedding's: sealed[0])
        partial = y.to(sealed[0].dtype) if partial is None else partial + y
        m = read(self.mlp_query(), sealed + [partial])
        return sealed, partial + self.ffn(m, router_infos)


class K3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        D = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(D, config.rms_norm_eps)
        self.output_attn_res_proj = nn.Linear(D, 1, bias=False)

    def output_query(self) -> torch.Tensor:
        return pseudo_query(self.output_attn_res_norm.weight, self.output_attn_res_proj.weight)

    def residual_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of the block representations and partial sums (`config.residual_dtype`): every layer keeps
        its input's, so the embedding's output sets it. In the activation dtype under autocast the norms, the
        AttnRes reads and the engine's gradient sums move half the bytes of fp32 and no linear casts its input."""
        if self.config.residual_dtype == "float32":  # fp64 models (the gradient checks) stay in fp64
            return torch.promote_types(self.embed_tokens.weight.dtype, torch.float32)
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.embed_tokens.weight.dtype

    def forward(self, input_ids, layout, cache=None, router_infos=None, mla_max_logits=None, inputs_embeds=None,
                blocks=None):
        """input_ids [B, T] -> final normed hidden states [B, T, D]. `inputs_embeds` [B, T, D] replaces
        `embed_tokens(input_ids)` (the multimodal model splices image rows into it, docs/vision.md).
        `blocks` (a list or `Collector`): gets the AttnRes block representations b_0 … b_n (b_0 the embedding, b_n
        the last, possibly partial, block), then the output read before `norm`: the speculative draft's features
        (docs/speculative.md)."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        h = h.to(self.residual_dtype(input_ids.device))
        if self._two_phase():
            h = self._layers_two_phase(h, layout, cache, router_infos, mla_max_logits, blocks)
        else:
            h = self._layers_direct(h, layout, cache, router_infos, mla_max_logits, blocks)
        if blocks is not None:
            blocks.append(h)
        return self.norm(h)

    def _block_queries(self) -> int:
        """The most reads one block makes: two per layer, plus the output read in the last block."""
        S, L = self.config.attn_res_block_size, len(self.layers)
        return max(2 * min(S, L - i) + (i + S >= L) for i in range(0, L, S))

    def _two_phase(self) -> bool:
        """The AttnRes wiring (module docstring of k3.model.attn_res): two-phase or direct."""
        if self.config.attn_res_impl != "two_phase" or self.config.residual == "plain":
            return False
        if torch.is_grad_enabled() and getattr(self.layers[0].forward, "k3_checkpointed", False):
            raise ValueError("attn_res_impl='two_phase' is not checkpointed per layer; with activation "
                             "checkpointing use 'auto' or 'triton' (the direct wiring)")
        return True

    def _layers_direct(self, h, layout, cache, router_infos, mla_max_logits, blocks=None):
        read = select_read(self.config.attn_res_impl, h)
        if self.config.residual == "plain":  # the ablation baseline: every read is the plain residual sum
            read = plain_residual_read
        sealed: list[torch.Tensor] = []
        partial = h
        for layer in self.layers:
            sealed, partial = layer(sealed, partial, layout, cache, router_infos, mla_max_logits, read)
        if blocks is not None:
            blocks.extend(sealed + [partial])
        return read(self.output_query(), sealed + [partial])

    def _layers_two_phase(self, h, layout, cache, router_infos, mla_max_logits, blocks=None):
        """Same result as `_layers_direct`; sealed sources are read once per block (docs/architecture.md §4.4)."""
        S, L = self.config.attn_res_block_size, len(self.layers)
        fused = fused_two_phase_available(h, self._block_queries())
        sealed: list[torch.Tensor] = []
        partial = h
        for layer in self.layers:
            i = layer.layer_idx
            if i % S == 0:
                sealed.append(partial)
                partial = None
                block = self.layers[i : min(i + S, L)]
                queries = [lay.attn_query() for lay in block] + [lay.mlp_query() for lay in block]
                if i + S >= L:
                    queries.append(self.output_query())
                # query slots: attn reads of the block, then its mlp reads, then the output read
                read = block_reads(torch.stack(queries), sealed, fused)
                block_start, block_len = i, len(block)
            y = layer.run_mixer(read(i - block_start, layer.attn_query(), partial), layout, cache, mla_max_logits)
            partial = y.to(sealed[0].dtype) if partial is None else partial + y
            m = read(block_len + i - block_start, layer.mlp_query(), partial)
            partial = partial + layer.ffn(m, router_infos)
        if blocks is not None:
            blocks.extend(sealed + [partial])
        return read(2 * block_len, self.output_query(), partial)


class K3ForCausalLM(nn.Module):
    """The K3 language model. Build with `build_model` for seeded initialisation."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.impl = config.norm_impl

    def new_cache(self, batch_size: int) -> K3Cache:
        return K3Cache(self.config.num_hidden_layers, batch_size)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                cache: K3Cache | None = None, return_router_infos: bool = False,
                return_mla_max_logits: bool = False, logits_at: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> K3Output:
        """input_ids [B, T] int. Returns logits [B, T, V], or [n, V] at the flat positions (into B·T)
        given by `logits_at` [n] — what a decoding engine needs, without the head's cost at every token.
        With `labels` [B, T] (ignore_index where unlabelled) it returns the summed loss instead of logits,
        through `config.loss_impl` (on CUDA chunked, with the Triton row kernel: the [B·T, V] logits never
        exist at once). `inputs_embeds` [B, T, D] on the model's device: the embedding rows to run instead of
        `embed_tokens(input_ids)` (image rows spliced in, docs/vision.md); input_ids are still checked.

        - Training / packed prefill: `cu_seqlens` [N+1] offsets into the flattened B·T tokens
          (every row boundary must be a document boundary); nothing crosses documents.
        - Incremental: pass a `K3Cache` (from `new_cache(B)`); it is updated in place and returned.
        - Ragged incremental (the inference engine's): a cache of N sequences with any lengths and
          input_ids [1, T] holding N packed documents (`cu_seqlens` [N+1]); document n continues sequence n.

        input_ids and labels may be on the host while the model is on a GPU: they are checked there and copied
        from pinned memory without the host waiting for the GPU (checking device ids reads them back, which
        waits for every kernel queued before, e.g. the previous step's optimizer).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        B, T = input_ids.shape
        if T == 0:
            raise ValueError("input_ids has no tokens")
        if labels is not None and (labels.shape != input_ids.shape or logits_at is not None):
            raise ValueError(f"labels must be [B, T] = {list(input_ids.shape)} and exclude logits_at, "
                             f"got {list(labels.shape)}")
        ranges = list(torch.aminmax(input_ids))
        if labels is not None:  # the labels' range in the same read back (the loss kernels index by label)
            ranges += torch.aminmax(torch.where(labels == self.config.ignore_index, 0, labels))
        ranges = torch.stack([r.long() for r in ranges]).tolist()  # one read back, not two or four
        lo, hi = ranges[:2]
        V = self.config.vocab_size
        if lo < 0 or hi >= V:
            raise ValueError(f"token ids must be in [0, {V}), got range [{lo}, {hi}]")
        if labels is not None and (ranges[2] < 0 or ranges[3] >= V):
            raise ValueError(f"labels must be in [0, {V}) or ignore_index ({self.config.ignore_index}), got range "
                             f"[{ranges[2]}, {ranges[3]}]")
        device = self.model.embed_tokens.weight.device  # host ids and labels: checked above, copied now
        input_ids = to_device_without_waiting(input_ids, device)
        labels = to_device_without_waiting(labels, device) if labels is not None else None
        layout = SequenceLayout.build(B, T, cu_seqlens, device)
        if cache is not None and cu_seqlens is not None:
            if B != 1:
                raise ValueError("with a cache, packed documents must come as one row (input_ids [1, T])")
            cache.check_batch(layout.cu_seqlens.numel() - 1)
            layout.past_lengths = list(cache.lengths)
        elif cache is not None:
            cache.check_batch(B)
            if len(set(cache.lengths)) != 1:
                raise ValueError("the cached sequences have different lengths; continue them with packed input "
                                 "(input_ids [1, T] and cu_seqlens, one document per sequence)")
        router_infos = Collector() if return_router_infos else None
        max_logits = Collector() if return_mla_max_logits else None
        if inputs_embeds is not None and tuple(inputs_embeds.shape) != (B, T, self.config.hidden_size):
            raise ValueError(f"inputs_embeds must be [B, T, D] = {[B, T, self.config.hidden_size]}, "
                             f"got {list(inputs_embeds.shape)}")
        h = self.model(input_ids, layout, cache, router_infos, max_logits, inputs_embeds=inputs_embeds)
        loss = logits = None
        if labels is not None:
            loss = linear_cross_entropy(h.reshape(B * T, -1), self.lm_head.weight, labels.reshape(B * T),
                                        self.config.ignore_index, self.config.loss_impl)
        else:
            if logits_at is not None:
                h = h.reshape(B * T, -1)[logits_at]  # [n, D]
            logits = self.lm_head(h)
        if cache is not None:
            if cu_seqlens is not None:
                offsets = layout.host_offsets()
                added = [b - a for a, b in zip(offsets, offsets[1:])]
            else:
                added = [T] * B
            cache.lengths = [n + a for n, a in zip(cache.lengths, added)]
        return K3Output(
            logits=logits,
            cache=cache,
            router_infos=list(router_infos) if router_infos is not None else None,
            mla_max_logits=torch.stack(list(max_logits)) if max_logits else None,
            loss=loss,
        )

    def decode_step(self, input_ids: torch.Tensor, cache: K3Cache,
                    router_infos: Collector | None = None) -> torch.Tensor:
        """One token per sequence against a paged cache (`PagedKDAState` / `PagedMLALatent` per layer, updated in
        place): input_ids [B, 1] on the model's device -> logits [B, V]. The inference engine's decode step:
        static shapes and no host sync (unlike `forward`, it does not read the ids back to check them; the
        engine's own sampler produced them), so it can be captured as a CUDA graph. `router_infos`: gets every MoE
        layer's RouterInfo (RL routing replay records them)."""
        B = input_ids.shape[0]
        h = self.model(input_ids, SequenceLayout(B, 1), cache, router_infos)
        return self.lm_head(h[:, 0])

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Seeded, deterministic init. Every tensor draws from its own generator, seeded from (seed, name),
        so the result does not depend on construction order, device placement or sharding."""
        std = self.config.initializer_range

        def gen(name: str, device) -> torch.Generator:
            return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)

        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if name.endswith("_res_proj"):
                    module.weight.zero_()  # AttnRes reads start as uniform averages
                else:
                    module.weight.normal_(0.0, std, generator=gen(name, module.weight.device))
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std, generator=gen(name, module.weight.device))
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, nn.Conv1d):
                bound = 1.0 / module.weight.shape[-1] ** 0.5  # PyTorch's default for a depthwise conv
                module.weight.uniform_(-bound, bound, generator=gen(name, module.weight.device))
            elif isinstance(module, LatentExperts):
                for pname, p in module.named_parameters():
                    p.normal_(0.0, std, generator=gen(f"{name}.{pname}", p.device))
            elif isinstance(module, StableLatentMoE):
                module.gate.weight.normal_(0.0, std, generator=gen(f"{name}.gate", module.gate.weight.device))
                module.gate.e_score_correction_bias.zero_()
            if isinstance(module, KimiDeltaAttention):
                module.reset_special_parameters(gen(f"{name}.dt_bias", module.dt_bias.device))

    def fp32_tensor_names(self) -> list[str]:
        """Parameters and buffers kept in fp32 whatever the model dtype (as stored in the release)."""
        names = []
        for name, module in self.named_modules():
            if isinstance(module, KimiDeltaAttention):
                names += [f"{name}.{p}" for p in KimiDeltaAttention.fp32_params]
            elif isinstance(module, StableLatentMoE):
                names.append(f"{name}.gate.e_score_correction_bias")
        return names

    def cast(self, dtype: torch.dtype) -> K3ForCausalLM:
        """Cast to `dtype`, keeping the KDA gate/conv/norm tensors and router biases in fp32."""
        self.to(dtype)
        keep = set(self.fp32_tensor_names())
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            if name in keep:
                t.data = t.data.float()
        return self


def build_model(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> K3ForCausalLM:
    """Construct on the meta device, materialise on `device`, initialise from `seed`, cast to `dtype`."""
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model.cast(dtype)
