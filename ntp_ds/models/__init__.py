"""Llama model with nonuniform tensor parallelism, loadable from and savable to Hugging Face form."""

from ntp_ds.models.config import LlamaConfig
from ntp_ds.models.llama import Llama

__all__ = ["Llama", "LlamaConfig"]
