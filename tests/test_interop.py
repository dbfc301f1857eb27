"""atencion.interop.from_hf / to_hf pick the converter of each Hugging Face family."""

import pytest
import torch

from atencion.errors import AtencionError
from atencion.interop import from_hf, to_hf


def small_hf_models():
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    bert = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=20, pad_token_id=0)
    gpt2 = GPT2Config(vocab_size=99, n_embd=32, n_layer=1, n_head=2, n_positions=20, bos_token_id=98, eos_token_id=98)
    t5 = T5Config(vocab_size=99, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    return [("encoder", BertForMaskedLM(bert)), ("decoder", GPT2LMHeadModel(gpt2)),
            ("encoder-decoder", T5ForConditionalGeneration(t5))]


@pytest.mark.parametrize("arch, hf_model", small_hf_models(), ids=["bert", "gpt2", "t5"])
def test_from_hf_then_to_hf_gives_back_the_same_weights_and_logits(arch, hf_model):
    hf_model.eval()
    model = from_hf(hf_model)
    assert model.cfg.arch == arch
    back = to_hf(model)
    assert type(back) is type(hf_model)
    ids = torch.randint(1, 99, (2, 7))
    with torch.no_grad():
        if arch == "encoder-decoder":
            theirs = [m(input_ids=ids, decoder_input_ids=ids).logits for m in (hf_model, back)]
        else:
            theirs = [m(input_ids=ids).logits for m in (hf_model, back)]
    torch.testing.assert_close(theirs[0], theirs[1])
    ours = model(ids, ids) if arch == "encoder-decoder" else model(ids)
    torch.testing.assert_close(ours, theirs[0], atol=1e-4, rtol=1e-4)


def test_an_unsupported_class_is_named():
    with pytest.raises(AtencionError, match="torch.nn.Linear|Linear is not supported"):
        from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(AtencionError, match="unknown family"):
        to_hf(from_hf(small_hf_models()[0][1].eval()), family="gemma")
