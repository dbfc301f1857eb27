from pathlib import Path

import pytest
import torch

from atencion import ModelConfig, Transformer


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `atencion ARGV` in this process."""
    from atencion.cli import main

    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's errors
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


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


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """A model trained on the demo's grammar (the demo's config, 250 updates, no validation):
    it translates "el gato negro come el ratón" as "the black cat eats the mouse"."""
    from atencion.demo import grammar
    from atencion.demo.run import DEFAULT_CONFIG
    from atencion.train.config import load_config
    from atencion.train.trainer import train

    out = tmp_path_factory.mktemp("demo-model")
    pairs, _ = grammar.split(5000, 10, seed=0)
    files = grammar.write_corpus(pairs, out / "data", "train")
    cfg = load_config(DEFAULT_CONFIG, [f"data.train_src={files['es']}", f"data.train_tgt={files['en']}",
                                       "train.max_steps=250", "train.time_limit_minutes=0", "train.progress=false",
                                       "train.tensorboard=false", "train.keep_last=1"])
    summary = train(cfg, out / "run")
    return Path(summary["last_checkpoint"])
