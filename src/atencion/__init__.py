"""atencion: the Transformer of "Attention Is All You Need" and its family (BERT, GPT, T5), to
train, decode, score, serve and inspect."""

from .interrupt import remembering_ctrl_c

with remembering_ctrl_c(defer=True):  # a Ctrl-C while torch and numpy load: raised once they have (interrupt.py)
    from .config import ModelConfig
    from .nn.model import Model
    from .nn.model_dir import load_model
    from .nn.transformer import Transformer

__all__ = ["Model", "ModelConfig", "Transformer", "load"]
__version__ = "0.1.0"


def load(directory, map_location="cpu") -> Model:
    """The model saved in ``directory`` (config.json + model.safetensors), whatever its ``arch``:
    an encoder-decoder, an encoder (BERT-style), a decoder (GPT-style) or an RNN encoder-decoder."""
    return load_model(directory, map_location)
