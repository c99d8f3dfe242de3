"""Native multimodality: MoonViT-V2, the sd2_tpool merge, the patchmergerv2 projector, preprocessing and data
(docs/vision.md; docs/architecture.md §7).

- `preprocess`: Pillow images and short videos → normalised patches, NaViT packing, limits.
- `tower`, `attention`, `projector`: the tower (2-D RoPE, varlen attention), the merge and the projector.
- `model`: `K3VisionLanguageModel`, the text model with the tower and projector; `build_vlm`.
- `prompt`: the media prompt and `<|media_pad|>` expansion; `chat`: conversations with `image_url` parts → ids
  and images (the server, `k3 chat`, the training rows); `data`: multimodal JSONL → packed batches (also as
  `k3 train`'s and `k3 sft`'s data source);
  `synthetic`: the generated image–text data set (`k3 data make-vision`); `optim`: the tower's optimizer groups.
"""
