"""Optional Hugging Face transformers integration: `AutoModelForCausalLM.from_pretrained(release_dir)`.

    from k3.hf import register
    register()  # AutoConfig / AutoModelForCausalLM learn model_type "kimi_k3"
    model = AutoModelForCausalLM.from_pretrained("path/to/Kimi-K3")      # a KimiK3ForCausalLM
    out = model.generate(input_ids, max_new_tokens=32)                   # greedy by default
    model.save_pretrained("path/to/copy")                                # the release layout again

`KimiK3ForCausalLM` is a thin `PreTrainedModel` wrapper: `.k3` is k3's own `K3ForCausalLM`, loaded by
`k3.convert.release.load_release` (so MXFP4 experts, dtypes and the tensor-name checks are k3's), and
`save_pretrained` is `save_release`. transformers' own weight loading, generation loop and cache classes
are not used: `generate` is k3's plain loop (`k3.infer.generate.generate_steps`: prefill, then decode over
`K3Cache`, whose hybrid KDA state + MLA latent cache has no transformers equivalent), greedy or sampled
(temperature / top-k / top-p), with the usual `[B, T + new]` result, stopping at `eos_token_id` and padding
finished rows with `pad_token_id`.
Prompts in a batch must have equal length (no padding: a KDA state cannot skip pad tokens).
`forward` returns `CausalLMOutputWithPast` with the `K3Cache` as `past_key_values`.

transformers is imported only when these classes are first used (`pip install 'k3[hf]'`); the release's
`auto_map` remote code is never run (a registered local class wins over remote code). A front end like
`k3.cli`: it joins the checkpoint converter (`k3.convert`) and the generation loop (`k3.infer`).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from k3.config import ModelConfig
from k3.convert.names import experts_are_packed
from k3.convert.release import load_release, read_release_config, save_release
from k3.infer.api import SamplingParams
from k3.infer.generate import generate_steps
from k3.model.model import build_model
from k3.vision.model import K3VisionLanguageModel

MODEL_TYPE = "kimi_k3"


def _require_transformers() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError("k3.hf needs the optional dependency transformers>=4.45: "
                          "pip install 'k3[hf]' (or pip install transformers)") from e


@lru_cache(maxsize=1)
def _classes() -> dict[str, type]:
    _require_transformers()
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # transformers 5 renamed the output's `past_key_values` to `cache`
    cache_field = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} \
        else "past_key_values"

    class KimiK3Config(PretrainedConfig):
        """The release's nested config.json (top level + `text_config` + `vision_config` dicts)."""

        model_type = MODEL_TYPE

        def __init__(self, text_config: dict | None = None, vision_config: dict | None = None, **kwargs):
            self.text_config = text_config
            self.vision_config = vision_config
            super().__init__(**kwargs)

        def get_text_config(self, *args, **kwargs):
            # text_config stays a plain dict (the release's layout); the top level carries the token ids
            return self

        def to_k3(self, **runtime: Any) -> ModelConfig:
            return ModelConfig.from_config_json(self.to_dict(), **runtime)

        @classmethod
        def from_k3(cls, config: ModelConfig) -> KimiK3Config:
            return cls(**config.to_config_json())

    class KimiK3ForCausalLM(PreTrainedModel, GenerationMixin):
        """`PreTrainedModel` around k3's `K3ForCausalLM` (`self.k3`)."""

        config_class = KimiK3Config
        base_model_prefix = "k3"
        main_input_name = "input_ids"
        _no_split_modules = ["DecoderLayer"]

        def __init__(self, config: KimiK3Config, k3_model=None):
            super().__init__(config)
            if k3_model is None:  # a fresh, seeded k3 init (transformers' `from_config`)
                k3_config = config.to_k3()
                k3_model = build_model(k3_config, dtype=getattr(torch, k3_config.dtype))
            self.k3 = k3_model
            self.k3_packed_experts: dict[str, torch.Tensor] = {}
            self.k3_vision: dict[str, torch.Tensor] = {}
            self.k3_source: Path | None = None
            self.k3_source_packed = False
            self.post_init()

        # k3 initialises its own weights (seeded per tensor); loaded weights must never be re-initialised
        def init_weights(self):
            pass

        def _init_weights(self, module):
            pass

        @classmethod
        def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, dtype=None,
                            torch_dtype=None, experts: str = "dequantize", **kwargs) -> KimiK3ForCausalLM:
            """Load a local release-layout directory with `k3.convert.release.load_release`.

            dtype / torch_dtype: the model dtype (default the config's, bf16; "auto" = the config's).
            experts: "dequantize" (default) or "packed" (kept in `.k3_packed_experts`, model experts on meta).
            Hub downloads are not supported: pass a directory.
            """
            path = Path(pretrained_model_name_or_path)
            if not path.is_dir():
                raise ValueError(f"{path} is not a local directory; k3 loads release-layout directories only")
            dtype = dtype if dtype is not None else torch_dtype
            if dtype == "auto":
                dtype = None
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
            if not isinstance(config, KimiK3Config):
                config = KimiK3Config.from_pretrained(path)
            ckpt = load_release(path, dtype=dtype, experts=experts)
            # with a tower and projector the wrapped model is the multimodal one (k3.vision; the text model shared)
            k3_model = K3VisionLanguageModel.from_parts(ckpt.model, ckpt.vision) if ckpt.vision else ckpt.model
            model = cls(config, k3_model=k3_model)
            model.k3_packed_experts, model.k3_source = ckpt.packed_experts, path
            model.k3_source_packed = experts_are_packed(read_release_config(path))
            return model.eval()

        def save_pretrained(self, save_directory, *, mxfp4: bool | None = None, max_shard_size: int | str = "5GB",
                            **kwargs) -> None:
            """Write the release layout (`save_release`). mxfp4: quantise the routed experts (default: as loaded).
            Other transformers arguments (safe_serialization, push_to_hub, ...) are not supported."""
            if kwargs.get("push_to_hub"):
                raise ValueError("push_to_hub is not supported; save to a directory and upload it yourself")
            mxfp4 = self.k3_source_packed if mxfp4 is None else mxfp4
            save_release(self.k3, save_directory, mxfp4=mxfp4 and not self.k3_packed_experts,
                         packed_experts=self.k3_packed_experts or None, vision=self._vision_tensors() or None,
                         shard_size=max_shard_size, copy_files_from=self.k3_source)

        def _vision_tensors(self) -> dict[str, torch.Tensor]:
            return self.k3.vision_state_dict() if isinstance(self.k3, K3VisionLanguageModel) else self.k3_vision

        def _media_rows(self, pixel_values: torch.Tensor | None, grid_thw: torch.Tensor | None):
            """The projector's rows for `pixel_values` [N, 3, 14, 14] / `grid_thw` [n, 3] (k3.vision.preprocess)."""
            if pixel_values is None and grid_thw is None:
                return None
            if not isinstance(self.k3, K3VisionLanguageModel):
                raise ValueError("this checkpoint has no vision tower (no vision_tower.* tensors): text input only")
            if pixel_values is None or grid_thw is None:
                raise ValueError("pixel_values and grid_thw come together")
            return self.k3.encode_media(pixel_values, grid_thw)

        def get_input_embeddings(self):
            return self.k3.model.embed_tokens

        def get_output_embeddings(self):
            return self.k3.lm_head

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    past_key_values=None, use_cache: bool | None = None, labels: torch.Tensor | None = None,
                    cache=None, pixel_values: torch.Tensor | None = None, grid_thw: torch.Tensor | None = None,
                    **kwargs) -> CausalLMOutputWithPast:
            """input_ids [B, T]; cache (or past_key_values): a `K3Cache`, updated in place, or None;
            labels [B, T] (shifted inside, -100 ignored). The cache comes back in the output's cache field.
            pixel_values [N, 3, 14, 14] and grid_thw [n, 3]: the images of the prompt's `<|media_pad|>` runs, in
            order (each pad expanded to its image's token count, docs/vision.md)."""
            _no_padding(attention_mask)
            cache = cache if cache is not None else past_key_values
            if cache is None and use_cache:
                cache = self.k3.new_cache(input_ids.shape[0])
            rows = self._media_rows(pixel_values, grid_thw)
            logits = self.k3(input_ids, cache=cache, **({"media_rows": rows} if rows is not None else {})).logits
            loss = None
            if labels is not None:
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                       ignore_index=-100)
            extra = {cache_field: cache} if cache is not None else {}
            return CausalLMOutputWithPast(loss=loss, logits=logits, **extra)

        @torch.no_grad()
        def generate(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                     generation_config=None, *, max_new_tokens: int | None = None, max_length: int | None = None,
                     do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                     top_p: float | None = None, eos_token_id: int | list[int] | None = None,
                     pad_token_id: int | None = None, **kwargs) -> torch.LongTensor:
            """input_ids [B, T] -> [B, T + generated] (k3's cache; greedy unless do_sample). `pixel_values` /
            `grid_thw` as in `forward`: the images enter with the prompt's prefill."""
            rows = self._media_rows(kwargs.pop("pixel_values", None), kwargs.pop("grid_thw", None))
            if input_ids is None:
                raise ValueError("generate needs input_ids [B, T]")
            if kwargs.get("num_beams", 1) != 1 or kwargs.get("return_dict_in_generate"):
                raise ValueError("k3's generate supports greedy and sampling only (no beams, no dict outputs)")
            _no_padding(attention_mask)
            gc = generation_config if generation_config is not None else self.generation_config

            def pick(value, name, default=None):
                if value is not None:
                    return value
                got = getattr(gc, name, None)
                return got if got is not None else default

            do_sample = pick(do_sample, "do_sample", False)
            eos = pick(eos_token_id, "eos_token_id", self.k3.config.eos_token_id)
            eos = (eos,) if isinstance(eos, int) else tuple(sorted(set(eos)))
            pad = pick(pad_token_id, "pad_token_id", self.k3.config.pad_token_id)
            T = input_ids.shape[1]
            new = max_new_tokens
            if new is None:  # transformers' precedence: max_new_tokens, then max_length (default 20)
                new = getattr(gc, "max_new_tokens", None) if max_length is None else None
                new = new if new is not None else pick(max_length, "max_length", 20) - T
            temperature = pick(temperature, "temperature", 1.0) if do_sample else 0.0
            top_k, top_p = pick(top_k, "top_k"), pick(top_p, "top_p")

            device = self.k3.lm_head.weight.device
            ids = input_ids.to(device)
            if new <= 0:
                return ids
            params = SamplingParams(max_tokens=new, temperature=temperature, top_k=top_k or 0,
                                    top_p=top_p if top_p is not None else 1.0, stop_token_ids=eos)
            generator = torch.Generator(device=device).manual_seed(int(torch.randint(2**62, (1,))))
            model = self.k3 if rows is None else _PrefillWithMedia(self.k3, rows)
            steps = generate_steps(model, ids, params, generator, pad_id=pad)
            return torch.cat([ids] + [step.tokens[:, None] for step in steps], dim=1)

    return {"KimiK3Config": KimiK3Config, "KimiK3ForCausalLM": KimiK3ForCausalLM}


class _PrefillWithMedia:
    """The model for `generate_steps` with the prompt's media rows bound to its first call (the prefill, which
    holds the `<|media_pad|>` tokens); the decode steps after it are plain calls."""

    def __init__(self, model: K3VisionLanguageModel, rows: torch.Tensor):
        self.model, self.rows, self.config = model, rows, model.config

    def parameters(self):
        return self.model.parameters()

    def new_cache(self, batch_size: int):
        return self.model.new_cache(batch_size)

    def __call__(self, input_ids: torch.Tensor, **kwargs):
        rows, self.rows = self.rows, None
        return self.model(input_ids, media_rows=rows, **kwargs) if rows is not None else self.model(input_ids, **kwargs)


def _no_padding(attention_mask: torch.Tensor | None) -> None:
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("padded batches are not supported (a KDA state cannot skip pad tokens); "
                         "pass equal-length prompts with no padding")


def register() -> None:
    """Register model_type "kimi_k3" with AutoConfig and AutoModelForCausalLM (idempotent)."""
    _require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    classes = _classes()
    AutoConfig.register(MODEL_TYPE, classes["KimiK3Config"], exist_ok=True)
    AutoModelForCausalLM.register(classes["KimiK3Config"], classes["KimiK3ForCausalLM"], exist_ok=True)


def __getattr__(name: str):
    if name in ("KimiK3Config", "KimiK3ForCausalLM"):
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
