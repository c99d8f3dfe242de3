"""transformers integration (`k3.hf`): AutoModelForCausalLM on a release-layout directory, generate = k3 greedy,
save."""

import importlib
import logging

import pytest
import torch

from k3.convert.release import load_release
from k3.infer.generate import generate
from tests.convert.test_release import assert_identical, read_all, write_release_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def release_dir(tmp_path_factory):
    return write_release_checkpoint(tmp_path_factory.mktemp("hf") / "k3-debug", seed=5)


@pytest.fixture(scope="module")
def hf_model(release_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from k3.hf import register

    register()
    register()  # idempotent
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = AutoConfig.from_pretrained(release_dir)
    assert type(config).__name__ == "KimiK3Config" and config.model_type == "kimi_k3"
    model = AutoModelForCausalLM.from_pretrained(release_dir)
    assert type(model).__name__ == "KimiK3ForCausalLM"
    return model


def test_generate_equals_k3_greedy(hf_model, release_dir):
    ref = load_release(release_dir).model
    eos = ref.config.eos_token_id
    n = 12
    for prompt in ([ref.config.bos_token_id, 5, 6, 7, 8], [17, 200, 3]):
        expected = list(generate(ref, prompt, n, temperature=0, stop_ids={eos}))
        if len(expected) < n:
            expected.append(eos)  # transformers keeps the stop token
        got = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n)
        assert got[0].tolist() == prompt + expected


def test_forward_and_batched_generate(hf_model, release_dir):
    ref = load_release(release_dir).model
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    out = hf_model(ids, labels=ids, use_cache=True)
    with torch.no_grad():
        assert torch.equal(out.logits, ref(ids).logits)
    assert torch.isfinite(out.loss)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    assert cache.seq_len == 9
    batched = hf_model.generate(ids, max_new_tokens=4, pad_token_id=0)
    assert batched.shape[0] == 2 and batched.shape[1] <= 13 and torch.equal(batched[:, :9], ids)
    torch.manual_seed(0)
    sampled = hf_model.generate(ids, do_sample=True, top_k=5, max_new_tokens=3)
    assert sampled.shape[1] <= 12
    with pytest.raises(ValueError, match="padded batches"):
        hf_model.generate(ids, attention_mask=torch.tensor([[0] + [1] * 8, [1] * 9]))


def test_save_pretrained_writes_the_release_layout(hf_model, release_dir, tmp_path):
    hf_model.save_pretrained(tmp_path / "saved", max_shard_size="200KB")
    assert_identical(read_all(release_dir), read_all(tmp_path / "saved"))
    assert (tmp_path / "saved" / "tiktoken.model").read_bytes() == (release_dir / "tiktoken.model").read_bytes()
    from transformers import AutoModelForCausalLM

    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(again.generate(ids, max_new_tokens=5), hf_model.generate(ids, max_new_tokens=5))


def test_the_front_end_lives_outside_convert():
    """`convert` depends on the model and the checkpoint format only; the wrapper, which also needs the
    generation loop, is the front end `k3.hf`."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("k3.convert.hf")
