"""Training data: record sources, tokenizers and the deterministic, checkpointable batch pipeline (grain).

  make_pipeline, Pipeline                  batches of token rows with segment ids and loss masks (`pipeline`)
  TextSource, RandomTokens                 the text corpus (`make data`) and random ids (`sources`)
  TokenRows, TokenDocuments                your own corpus, prepared by `python -m osdn_jax.data.prepare` (`tokens`)
  MQARSource, PasskeySource                the recall tasks: MQAR (also read twice) and passkey retrieval (`recall`)
  ByteTokenizer, BPETokenizer, make_tokenizer   UTF-8 bytes, and a byte-level BPE trained on the corpus (`tokenizers`)
"""
from osdn_jax.data.pipeline import DEFAULTS, SOURCES, Pipeline, make_pipeline
from osdn_jax.data.recall import IGNORE, MQARSource, PasskeySource
from osdn_jax.data.sources import RandomTokens, TextSource, default_text_dir
from osdn_jax.data.tokenizers import TOKENIZERS, BPETokenizer, ByteTokenizer, make_tokenizer
from osdn_jax.data.tokens import TokenDocuments, TokenRows

__all__ = ["DEFAULTS", "IGNORE", "SOURCES", "Pipeline", "make_pipeline", "MQARSource", "PasskeySource",
           "RandomTokens", "TextSource", "default_text_dir", "TOKENIZERS", "BPETokenizer", "ByteTokenizer",
           "make_tokenizer", "TokenDocuments", "TokenRows"]
