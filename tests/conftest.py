import pytest
import torch

from atencion import ModelConfig, Transformer


def small_config(**overrides) -> ModelConfig:
    values = dict(vocab_size=40, n_layers=2, d_model=32, d_ff=64, n_heads=4, dropout=0.1,
                  pad_id=0, bos_id=2, eos_id=3)
    values.update(overrides)
    return ModelConfig(**values)


def small_model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(small_config(**overrides)).eval()
    # LayerNorm gains and biases start at 1 and 0; randomise them so tests see every parameter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def random_batch(cfg: ModelConfig, batch=3, src_len=7, tgt_len=6, seed=1):
    """Source with right padding in every row but the first, and a target that starts with BOS."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, cfg.vocab_size, (batch, src_len), generator=g)
    for row in range(1, batch):
        src[row, src_len - row:] = cfg.pad_id
    tgt = torch.randint(4, cfg.target_vocab_size, (batch, tgt_len), generator=g)
    tgt[:, 0] = cfg.bos_id
    return src, tgt


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
