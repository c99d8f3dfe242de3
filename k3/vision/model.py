"""The multimodal K3: the text model with MoonViT-V2 and the patchmergerv2 projector (docs/vision.md).

Legend: B rows, T tokens, D text width, N packed patches, M merged media tokens.

    pixel_values [N, 3, 14, 14], grid_thw [n, 3] ─ vision_tower ─ sd2_tpool ─ mm_projector ─▶ rows [M, D]
    input_ids [B, T] ─ embed_tokens ─▶ [B, T, D], its M `<|media_pad|>` rows replaced in order ─▶ text stack

`K3VisionLanguageModel` is a `K3ForCausalLM` (the text model's names, forward, cache, init and casting are
unchanged) with two more modules under the release's names, `vision_tower` and `mm_projector`; a text-only
forward is the text model's. The model package never imports this one. The tower trains from scratch jointly
with the language model (K3 report §2.4), through the same forward and loss.
"""

from __future__ import annotations

import zlib

import torch

from k3.config import ModelConfig
from k3.model.model import K3ForCausalLM, K3Output
from k3.vision.projector import PatchMergerV2, sd2_tpool
from k3.vision.tower import MoonViT

VISION_PREFIXES = ("vision_tower.", "mm_projector.")


def is_vision_parameter(name: str) -> bool:
    return name.startswith(VISION_PREFIXES)


class K3VisionLanguageModel(K3ForCausalLM):
    """The K3 language model plus `vision_tower` (MoonViT-V2) and `mm_projector` (patchmergerv2)."""

    def __init__(self, config: ModelConfig):
        if config.vision_config is None:
            raise ValueError("this config has no vision_config; a multimodal model needs one")
        if config.vision_config.text_hidden_size != config.hidden_size:
            raise ValueError(f"vision_config.text_hidden_size ({config.vision_config.text_hidden_size}) must equal "
                             f"hidden_size ({config.hidden_size})")
        super().__init__(config)
        self.vision_tower = MoonViT(config.vision_config, config.attention_backend)
        self.mm_projector = PatchMergerV2(config.vision_config)
        self.mm_projector.post_norm.impl = config.norm_impl

    def encode_media(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, 3, p, p], grid_thw [n, 3] → the projector's rows [M, D], items in order."""
        grid = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        device = self.model.embed_tokens.weight.device
        features = self.vision_tower(pixel_values.to(device), grid)
        return self.mm_projector(sd2_tpool(features, grid))

    def splice_media(self, input_ids: torch.Tensor, media_rows: torch.Tensor,
                     media_mask: torch.Tensor | None = None) -> torch.Tensor:
        """embed_tokens(input_ids) [B, T, D] with the `<|media_pad|>` rows replaced by media_rows [M, D], in order
        of appearance (row-major over B·T), in the embedding's dtype. `media_mask` [B, T] bool: the positions to
        replace instead (the engine's: its prompts' pads, not a pad token the model generated)."""
        embeds = self.model.embed_tokens(input_ids)
        if media_mask is None:
            is_pad = input_ids == self.config.media_placeholder_token_id
        else:
            is_pad = media_mask.to(device=input_ids.device, dtype=torch.bool)
        pads = int(is_pad.sum())
        if pads != media_rows.shape[0]:
            raise ValueError(f"input_ids hold {pads} <|media_pad|> token(s) but the media give {media_rows.shape[0]} "
                             "row(s); expand each item's pad to its token count (k3.vision.prompt)")
        return embeds.masked_scatter(is_pad[..., None], media_rows.to(embeds.dtype))

    def forward(self, input_ids: torch.Tensor, *args, pixel_values: torch.Tensor | None = None,
                grid_thw: torch.Tensor | None = None, media_rows: torch.Tensor | None = None,
                media_mask: torch.Tensor | None = None, **kwargs) -> K3Output:
        """The text model's forward (same arguments), plus the media of the `<|media_pad|>` tokens in input_ids:
        `pixel_values` [N, 3, p, p] with `grid_thw` [n, 3] (run through the tower and projector), or the
        projector's `media_rows` [M, D] computed before (an engine's per-image cache); `media_mask` [B, T] says
        which positions take the rows (default: every pad). Labels that target a pad are ignored. Without media
        the forward is the text model's; pads without media are an error."""
        if pixel_values is not None and media_rows is not None:
            raise ValueError("give pixel_values (with grid_thw) or media_rows, not both")
        if (pixel_values is None) != (grid_thw is None):
            raise ValueError("pixel_values and grid_thw come together")
        device = self.model.embed_tokens.weight.device
        ids = input_ids.to(device)
        if pixel_values is not None:
            media_rows = self.encode_media(pixel_values, grid_thw)
        if media_rows is not None:
            kwargs["inputs_embeds"] = self.splice_media(ids, media_rows, media_mask)
        elif media_mask is not None:
            raise ValueError("media_mask needs media_rows (or pixel_values with grid_thw)")
        elif bool((ids == self.config.media_placeholder_token_id).any()):
            raise ValueError("input_ids hold <|media_pad|> tokens but no pixel_values / media_rows were given")
        if kwargs.get("labels") is not None:
            labels = kwargs["labels"]
            kwargs["labels"] = labels.masked_fill(labels == self.config.media_placeholder_token_id,
                                                  self.config.ignore_index)
        return super().forward(input_ids, *args, **kwargs)

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """The text model's seeded init (which also covers the tower's and projector's linears and norms: every
        tensor from its own generator seeded by (seed, name)), then the tower's conv and position grid."""
        super().init_weights(seed)

        def generator_for(name: str, device) -> torch.Generator:
            return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)

        self.vision_tower.init_weights(generator_for)

    def text_named_parameters(self):
        """(name, parameter) of the language model: what `k3.optim.MuonAdamW` routes by its name table."""
        return ((n, p) for n, p in self.named_parameters() if not is_vision_parameter(n))

    def vision_state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The tower and projector tensors under their release names (`vision_tower.…`, `mm_projector.…`)."""
        return {n: t for n, t in self.state_dict(keep_vars=keep_vars).items() if is_vision_parameter(n)}

    @classmethod
    def from_parts(cls, text_model: K3ForCausalLM, vision_tensors: dict[str, torch.Tensor]) -> K3VisionLanguageModel:
        """A multimodal model around a loaded text model (its modules are shared, not copied) and the tower and
        projector tensors by release name, e.g. `k3.convert.release.load_release(path)`'s `.model` and `.vision`."""
        with torch.device("meta"):
            model = cls(text_model.config)
        model.model, model.lm_head = text_model.model, text_model.lm_head
        own = {n for n in model.state_dict() if is_vision_parameter(n)}
        if set(vision_tensors) != own:
            odd = sorted(set(vision_tensors) ^ own)
            raise ValueError(f"vision tensors do not match the config's vision_config: e.g. {odd[0]!r} "
                             f"({len(odd)} name(s) differ)")
        embed = text_model.model.embed_tokens.weight  # the tower takes the text model's dtype and device
        model.load_state_dict({n: t.to(embed.device, embed.dtype) for n, t in vision_tensors.items()}, strict=False,
                              assign=True)
        return model.train(text_model.training)


def build_vlm(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
              dtype: torch.dtype = torch.float32) -> K3VisionLanguageModel:
    """`k3.model.model.build_model` for the multimodal model: meta construction, materialise, seeded init, cast."""
    with torch.device("meta"):
        model = K3VisionLanguageModel(config)
    model.to_empty(device=device)
    model.init_weights(seed)
    return model.cast(dtype)
