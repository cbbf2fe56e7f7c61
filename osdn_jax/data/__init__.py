"""Training data: record sources, tokenizers and the deterministic, checkpointable batch pipeline (grain).

  make_pipeline, Pipeline                  batches of packed token rows with segment ids and loss masks (`pipeline`)
  TextSource, RandomTokens, MQARSource     random-access records (`sources`); the text corpus comes from `make data`
  ByteTokenizer, BPETokenizer, make_tokenizer   UTF-8 bytes, and a byte-level BPE trained on the corpus (`tokenizers`)
"""
from osdn_jax.data.pipeline import DEFAULTS, SOURCES, Pipeline, make_pipeline
from osdn_jax.data.sources import MQARSource, RandomTokens, TextSource, default_text_dir
from osdn_jax.data.tokenizers import TOKENIZERS, BPETokenizer, ByteTokenizer, make_tokenizer

__all__ = ["DEFAULTS", "SOURCES", "Pipeline", "make_pipeline", "MQARSource", "RandomTokens", "TextSource",
           "default_text_dir", "TOKENIZERS", "BPETokenizer", "ByteTokenizer", "make_tokenizer"]
