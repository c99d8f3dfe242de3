"""The transformers wrapper takes images: pixel_values / grid_thw in forward and generate (k3.hf)."""

import logging

import pytest
import torch
from PIL import Image

from k3.convert.release import load_release
from k3.vision.model import K3VisionLanguageModel
from k3.vision.preprocess import pack, preprocess_image
from k3.vision.prompt import media_prompt
from tests.convert.test_release import write_release_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    return write_release_checkpoint(tmp_path_factory.mktemp("hfv") / "k3-debug", seed=7, packed=False)


def test_images_through_forward_and_generate(release_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from k3.hf import register
    from k3.tokenizer import Tokenizer

    register()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    hf = AutoModelForCausalLM.from_pretrained(release_dir, dtype=torch.float32)
    assert isinstance(hf.k3, K3VisionLanguageModel)
    ckpt = load_release(release_dir, dtype=torch.float32)
    ref = K3VisionLanguageModel.from_parts(ckpt.model, ckpt.vision)
    tok = Tokenizer.load(release_dir)
    items = [preprocess_image(Image.new("RGB", (50, 40), (250, 20, 20))),
             preprocess_image(Image.new("RGB", (28, 60), (20, 20, 250)))]
    ids = [tok.bos_id] + [t for it in items for t in media_prompt(tok, it.width, it.height, it.num_tokens())]
    ids = torch.tensor([ids + tok.encode("ab")])
    media = pack(items).as_inputs()
    with torch.no_grad():
        want = ref(ids, **media).logits
        assert torch.equal(hf(ids, **media).logits, want)
        # greedy generation with the images: the prefill holds them, decoding continues on the cache
        out = hf.generate(ids, max_new_tokens=4, **media)
        cache, seq = ref.new_cache(1), ids
        logits = ref(ids, cache=cache, **media).logits[:, -1]
        for _ in range(4):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
            if int(nxt) == ref.config.eos_token_id:
                break
            logits = ref(nxt, cache=cache).logits[:, -1]
    assert out.tolist() == seq.tolist()
    with pytest.raises(ValueError, match="come together"):
        hf(ids, pixel_values=media["pixel_values"])
    # the multimodal model saves back to the same release bytes
    hf.save_pretrained(tmp_path / "saved", max_shard_size="200KB")
    again = load_release(tmp_path / "saved", dtype=torch.float32)
    assert all(torch.equal(again.vision[n], t) for n, t in ckpt.vision.items())


def test_text_only_checkpoint_refuses_images(tmp_path):
    from transformers import AutoModelForCausalLM

    from k3.config import get_preset
    from k3.hf import register

    register()
    path = write_release_checkpoint(tmp_path / "text", get_preset("debug").replace(vision_config=None), packed=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    item = preprocess_image(Image.new("RGB", (28, 28)))
    with pytest.raises(ValueError, match="no vision tower"):
        hf(torch.tensor([[1, 2]]), **pack([item]).as_inputs())
