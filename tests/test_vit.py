"""A ViT (Dosovitskiy et al. 2021) from the same blocks: the patch embedding is a convolution with
kernel = stride = patch, the encoder is permutation-equivariant over patches without positions
(and not with them), the 2-D sinusoids are the formula's, and the model equals Hugging Face's
ViTForImageClassification both ways."""

import math

import pytest
import torch
import torch.nn.functional as F

from atencion import ModelConfig, Transformer
from atencion.errors import AtencionError
from atencion.nn.inputs import PatchEmbedding

PATCHES = {"kind": "patches", "patch": 2, "size": [4, 6], "channels": 3}


def vit(**values) -> Transformer:
    base = dict(vocab_size=0, arch="encoder", n_layers=2, d_model=16, d_ff=32, n_heads=2, num_labels=3, dropout=0.0,
                norm_first=True, activation="gelu", positional="learned", max_positions=7, scale_embedding=False,
                inputs=PATCHES)
    return Transformer(ModelConfig(**{**base, **values})).eval()


def test_the_patch_embedding_is_a_convolution_with_kernel_and_stride_the_patch():
    torch.manual_seed(0)
    embed = PatchEmbedding(d_model=8, patch=2, size=(4, 6), channels=3)
    conv = torch.nn.Conv2d(3, 8, kernel_size=2, stride=2)
    with torch.no_grad():
        conv.weight.copy_(embed.proj.weight.reshape(8, 3, 2, 2))
        conv.bias.copy_(embed.proj.bias)
    images = torch.randn(5, 3, 4, 6)
    tokens, mask = embed(images)
    expected = conv(images).flatten(2).transpose(1, 2)  # (batch, rows · cols, d) in row-major order
    assert mask is None and tokens.shape == (5, 1 + 6, 8)
    torch.testing.assert_close(tokens[:, 1:], expected, rtol=0, atol=1e-6)
    assert torch.equal(tokens[:, 0], embed.cls[0].expand(5, -1))  # [CLS] first, the same for every image


def test_shifted_patch_tokenization_embeds_each_patch_of_the_image_and_its_four_diagonal_moves():
    torch.manual_seed(0)
    embed = PatchEmbedding(d_model=8, patch=2, size=(4, 6), channels=3, shifted=True)
    with torch.no_grad():
        embed.norm.weight.normal_(), embed.norm.bias.normal_()   # not the identity, so that it must be applied
    images = torch.randn(5, 3, 4, 6)

    def moved(dy, dx):  # pixel (r, c) of the copy is pixel (r + dy, c + dx) of the image, zero outside it
        out = torch.zeros_like(images)
        for r in range(4):
            for c in range(6):
                if 0 <= r + dy < 4 and 0 <= c + dx < 6:
                    out[..., r, c] = images[..., r + dy, c + dx]
        return out

    stack = torch.cat([images, moved(-1, -1), moved(-1, 1), moved(1, -1), moved(1, 1)], dim=1)   # 5C = 15 channels
    tokens, _ = embed(images)
    assert tokens.shape == (5, 1 + 6, 8) and embed.proj.in_features == 15 * 2 * 2
    for k in range(6):
        r, c = divmod(k, 3)
        patch = stack[:, :, 2 * r:2 * r + 2, 2 * c:2 * c + 2].reshape(5, -1)   # (channel, row, column) order
        normed = F.layer_norm(patch, (60,), embed.norm.weight, embed.norm.bias, embed.norm.eps)
        torch.testing.assert_close(tokens[:, 1 + k], normed @ embed.proj.weight.T + embed.proj.bias, rtol=0, atol=1e-5)


def _permute_patches(images: torch.Tensor, order: list[int], patch: int) -> torch.Tensor:
    """The image whose patch k (row-major) is patch order[k] of ``images``."""
    cols = images.size(-1) // patch
    out = torch.empty_like(images)
    for k, source in enumerate(order):
        (r, c), (sr, sc) = divmod(k, cols), divmod(source, cols)
        out[..., r * patch:(r + 1) * patch, c * patch:(c + 1) * patch] = \
            images[..., sr * patch:(sr + 1) * patch, sc * patch:(sc + 1) * patch]
    return out


def test_without_positions_permuting_the_patches_permutes_the_outputs_and_with_them_it_does_not():
    torch.manual_seed(0)
    model = vit()
    images = torch.randn(2, 3, 4, 6)
    order = [3, 0, 5, 1, 4, 2]
    permuted = _permute_patches(images, order, 2)
    with torch.no_grad():
        positions = model.encoder.positions.weight.clone()
        model.encoder.positions.weight.zero_()  # positions removed
        out, out_permuted = model(images), model(permuted)
        torch.testing.assert_close(out_permuted[:, 1:], out[:, 1:][:, order], rtol=0, atol=1e-5)
        torch.testing.assert_close(out_permuted[:, 0], out[:, 0], rtol=0, atol=1e-5)  # [CLS] sees a set
        model.encoder.positions.weight.copy_(positions)
        out, out_permuted = model(images), model(permuted)
    assert (out_permuted[:, 1:] - out[:, 1:][:, order]).abs().max() > 1e-2
    assert (out_permuted[:, 0] - out[:, 0]).abs().max() > 1e-2


def test_2d_sinusoids_give_a_patch_its_rows_sinusoids_then_its_columns_and_cls_zeros():
    model = vit(positional="sinusoidal-2d", d_model=16)
    table = model.encoder.positions(7)
    half = 8

    def pe(pos, i):  # §3.5 in half the width
        angle = pos / 10000 ** (2 * (i // 2) / half)
        return math.sin(angle) if i % 2 == 0 else math.cos(angle)

    assert torch.equal(table[0], torch.zeros(16))
    for k in range(6):
        r, c = divmod(k, 3)
        expected = torch.tensor([pe(r, i) for i in range(half)] + [pe(c, i) for i in range(half)])
        torch.testing.assert_close(table[1 + k], expected, rtol=0, atol=1e-6)
    assert model.classify(torch.randn(2, 3, 4, 6)).shape == (2, 3)
    with pytest.raises(AtencionError, match="positional 'sinusoidal-2d' needs d_model divisible by 4"):
        vit(positional="sinusoidal-2d", d_model=18)


def _hf_vit(**values):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.ViTConfig(**{**dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                              intermediate_size=48, image_size=[4, 6], patch_size=2, num_channels=3,
                                              num_labels=5), **values})
    model = transformers.ViTForImageClassification(config).eval()
    with torch.no_grad():  # random weights everywhere, not the zero-initialised [CLS] and positions
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_pytorch_tanh"])
def test_a_hugging_face_vit_imports_with_equal_logits(hidden_act):
    from atencion.interop import from_hf

    hf_model = _hf_vit(hidden_act=hidden_act)
    model = from_hf(hf_model)
    assert model.cfg.inputs == {**PATCHES, "shifted": False}
    assert model.cfg.max_positions == 7 and model.cfg.num_labels == 5
    images = torch.randn(3, 3, 4, 6)
    with torch.no_grad():
        torch.testing.assert_close(model.classify(images), hf_model(pixel_values=images).logits, rtol=0, atol=1e-5)


def test_an_atencion_vit_exports_to_hugging_face_with_equal_logits():
    pytest.importorskip("transformers")
    from atencion.interop import to_hf

    torch.manual_seed(1)
    model = vit(max_positions=10, labels=["a", "b", "c"])  # a longer table: its first 7 rows are exported
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    hf_model = to_hf(model)
    assert type(hf_model).__name__ == "ViTForImageClassification"
    assert hf_model.config.id2label == {0: "a", 1: "b", 2: "c"}
    images = torch.randn(3, 3, 4, 6)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(pixel_values=images).logits, model.classify(images), rtol=0, atol=1e-5)


@pytest.mark.parametrize("values, key", [(dict(positional="sinusoidal-2d"), "positional"),
                                         (dict(norm_first=False), "norm_first"), (dict(pooling="mean"), "pooling"),
                                         (dict(num_labels=0), "num_labels"),
                                         (dict(inputs={**PATCHES, "shifted": True}), "shifted")])
def test_what_vit_cannot_express_is_refused_naming_the_key(values, key):
    pytest.importorskip("transformers")
    from atencion.interop import to_hf

    with pytest.raises(AtencionError, match=key):
        to_hf(vit(**values))


def test_a_hugging_face_vit_directory_loads_as_an_atencion_model_without_a_tokenizer(tmp_path):
    from atencion.nn.model_dir import load_model_dir

    hf_model = _hf_vit()
    hf_model.save_pretrained(tmp_path)
    model, tokenizer = load_model_dir(tmp_path)
    assert tokenizer is None and model.cfg.inputs == {**PATCHES, "shifted": False}
    images = torch.randn(2, 3, 4, 6)
    with torch.no_grad():
        torch.testing.assert_close(model.classify(images), hf_model(pixel_values=images).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["vit-base", "vit-tiny"])
def test_the_vit_presets_count_the_parameters_of_hugging_faces_vit(name):
    transformers = pytest.importorskip("transformers")
    from atencion.interop.vit import vit_config

    cfg = ModelConfig.preset(name, num_labels=1000)
    with torch.device("meta"):  # counted, never allocated
        ours = Transformer(cfg).num_parameters()
        theirs = sum(p.numel() for p in transformers.ViTForImageClassification(vit_config(cfg)).parameters())
    assert ours == theirs
    backbone = ours - 1000 * (cfg.d_model + 1)
    assert f"{backbone / 1e6:.1f}M" == {"vit-base": "85.8M", "vit-tiny": "5.5M"}[name]


def test_the_digits_recipe_builds_a_vit_of_16_patches_and_cls():
    from atencion.train.config import load_config

    cfg = load_config("configs/digits_vit.yaml")
    built = cfg.model_config(0, None, {"task": "classify", "num_labels": 10})
    assert built.inputs == {"kind": "patches", "patch": 2, "size": [8, 8], "channels": 1, "shifted": True}
    assert (built.arch, built.norm_first, built.positional, built.max_positions, built.vocab_size) == \
        ("encoder", True, "learned", 17, 0)
    assert Transformer(built).classify(torch.rand(3, 1, 8, 8)).shape == (3, 10)
