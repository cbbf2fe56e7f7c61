"""The training input pipeline (grain): records → shuffled epochs → token rows → global batches → this process's
rows of each, deterministic and checkpointable, the same global batches on any number of processes.

    pipe = make_pipeline(cfg.data, seq_len=2048, batch_size=16, seed=0, process_index=0, process_count=1)
    batch = next(pipe)          # a dict of numpy arrays (below): this process's rows of the next global batch
    state = pipe.get_state()    # JSON-serialisable; set_state(state) on an equal pipeline resumes at this point

Stages: source → shuffle (a new order every epoch, endlessly) → rows → global batches of batch_size rows → this
process's rows of each → prefetch (a background thread, optional). Every process defines the same global stream
of rows from (config, seq_len, seed), so global batch s is a pure function of those and s, whatever the number of
processes: process p of P reads rows [p·r, (p + 1)·r) of every global batch (r = batch_size / P), or the rows
`rows` names; the P processes' batches, side by side, are the 1-process batch. The map-style sources ("tokens",
"random", "mqar", "passkey": one record is one row) read only this process's rows: row j of global batch s is
record s·batch_size + j of the shuffled, repeated source. The text source's rows come out of a stream (documents
tokenized and concatenated), so every process tokenizes and packs every global batch and keeps its rows: P
processes do the tokenizing of one P times over (cheap for the byte tokenizer; a BPE costs more per token).

Text: every record is tokenized with EOS appended, and the token stream is concatenated and split into rows of
seq_len + 1 tokens (grain's ConcatThenSplit; documents span rows, and no token is padding); a row r gives
tokens r[:-1] and targets r[1:]. "tokens" (shards of `python -m osdn_jax.data.prepare`, `tokens.TokenRows`): the
same rows, cut from the split's stream of documents each followed by EOS; one record is one row, so the shuffle
is over rows (the text source shuffles documents). "random": one record is one row of seq_len + 1 tokens. The
recall tasks ("mqar", "passkey"; `recall`) give rows of exactly seq_len tokens with their own labels.

A batch (B = this process's rows of the global batch; T = seq_len):
  tokens       int32 [B, T]    what the model reads
  targets      int32 [B, T]    the token to predict at each position (0 where nothing is scored)
  segment_ids  int32 [B, T]    the document of each position's target (`osdn_jax.ops.packing`'s convention:
                               non-decreasing, only the changes count): a segment starts right after an EOS
                               target, at the EOS that ends the previous document, which serves as the next
                               one's BOS. All 0 except for text.
  loss_mask    float32 [B, T]  1 where a prediction is scored: text, where the input token and the target belong
                               to one document (so 0 at an EOS input, whose target begins the next document);
                               the recall tasks, exactly at their labelled positions; random, everywhere

Every batch's tokens and targets are checked against the vocabulary before it is returned: an id outside
[0, vocab_size) raises `TokenIdError` (a ValueError) naming the array, the row (of the global batch), the position
and the id, so that no such id reaches the device (where it would embed as NaN).

Config fields (a mapping or `ml_collections.ConfigDict`; a missing field takes its `DEFAULTS` value):
  source        "text" | "tokens" | "random" | "mqar" | "passkey"
  path          "tokens": the directory `python -m osdn_jax.data.prepare` wrote (its metadata.json gives the
                vocabulary and EOS; tokenizer and vocab_size are ignored)
  tokenizer     "byte" | "bpe" (text only)
  vocab_size    the BPE's size; the id range of "random" and "mqar"; ignored by the byte tokenizer and passkey (256)
  text_dir      the corpus directory ("": `sources.default_text_dir()`)
  split         the text's blocks: "train" (all but the validation split), "validation" or "all"; "tokens": the
                prepared split ("all": train, then validation)
  block_chars   the text source's block size (`sources.TextSource`; 0: whole documents)
  num_records   distinct records of "random", "mqar" and "passkey" (one epoch)
  order         the records' order: "epoch" (a new permutation of all records every epoch) or "replacement"
                (every record of the stream drawn uniformly and independently from all records, so one recurs at
                any distance); "replacement" is for the map-style sources, not "text"
  mqar_pairs    key-value pairs per "mqar" row (kv)
  mqar_power    the power law of the query gaps (a)
  mqar_reads    times the kv block is written before the queries (1, or 2: read twice); seq_len is the row's
                length, so the queries get seq_len − 2·kv·mqar_reads tokens
  passkey_depth the needle's depth in [0, 1], or −1 for a uniform draw per row
  passkey_digits  digits of the passkey
  prefetch      batches prepared ahead in a background thread (0: none). The trainer's loop runs ahead of the
                device until it reads a logged step's metrics, so it takes up to log_every batches at once
                after each log: a depth below that makes it wait for batches while the device is still busy
"""
from __future__ import annotations

import base64
import collections.abc
import weakref
from typing import Any

import grain
import numpy as np

from osdn_jax.data import recall, sources, tokenizers, tokens

SOURCES = ("text", "tokens", "random", "mqar", "passkey")
DEFAULTS = dict(source="text", path="", tokenizer="byte", vocab_size=256, text_dir="", split="train",
                block_chars=8192, num_records=100_000, mqar_pairs=8, mqar_power=0.01, mqar_reads=1, passkey_depth=-1.0,
                passkey_digits=5, prefetch=16, order="epoch")
ORDERS = ("epoch", "replacement")
STATE_VERSION = 2
# Records are read in the thread that packs and batches them: they are in memory or computed, and cheap.
_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def _int_field(value, field: str, minimum: int, what: str = "data config") -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
    raise ValueError(f"{what}: `{field}` must be an int ≥ {minimum}, got {value!r}")
  return int(value)


def _fields(cfg) -> dict[str, Any]:
  """The config's fields (defaults filled in), checked: ValueError naming the field."""
  get = cfg.get if hasattr(cfg, "get") else (lambda name, default: getattr(cfg, name, default))
  f = {name: get(name, default) for name, default in DEFAULTS.items()}
  if f["source"] not in SOURCES:
    raise ValueError(f"data config: unknown `source` {f['source']!r}; choices: {', '.join(SOURCES)}")
  if f["tokenizer"] not in tokenizers.TOKENIZERS:
    raise ValueError(f"data config: unknown `tokenizer` {f['tokenizer']!r}; choices: "
                     f"{', '.join(tokenizers.TOKENIZERS)}")
  if not isinstance(f["text_dir"], (str, bytes)) and not hasattr(f["text_dir"], "__fspath__"):
    raise ValueError(f"data config: `text_dir` must be a path (\"\" for the default), got {f['text_dir']!r}")
  if not isinstance(f["path"], (str, bytes)) and not hasattr(f["path"], "__fspath__"):
    raise ValueError(f"data config: `path` must be a path, got {f['path']!r}")
  if f["source"] == "tokens" and not f["path"]:
    raise ValueError("data config: `path` must name the directory of prepared token shards for source = tokens "
                     "(`python -m osdn_jax.data.prepare --input=GLOB --tokenizer=SPEC --out=DIR`)")
  if f["order"] not in ORDERS:
    raise ValueError(f"data config: `order` must be one of {', '.join(ORDERS)}, got {f['order']!r}")
  if f["order"] == "replacement" and f["source"] == "text":
    raise ValueError("data config: `order` = replacement needs a source whose record is a row (tokens, random, "
                     "mqar, passkey); the text source's rows come out of a stream of documents")
  if f["split"] not in sources.SPLITS:
    raise ValueError(f"data config: `split` must be one of {', '.join(sources.SPLITS)}, got {f['split']!r}")
  for field, minimum in (("vocab_size", 1), ("num_records", 1), ("mqar_pairs", 1), ("mqar_reads", 1),
                         ("passkey_digits", 1), ("prefetch", 0), ("block_chars", 0)):
    f[field] = _int_field(f[field], field, minimum)
  if f["source"] == "text" and f["tokenizer"] == "bpe" and f["vocab_size"] < 257:
    raise ValueError(f"data config: `vocab_size` of the BPE must be ≥ 257 (256 bytes and EOS), got {f['vocab_size']}")
  depth = f["passkey_depth"]
  if not isinstance(depth, (int, float)) or isinstance(depth, bool) or not (0 <= depth <= 1 or depth == -1):
    raise ValueError(f"data config: `passkey_depth` must be in [0, 1] or -1 (random), got {depth!r}")
  return f


def _recall_source(f, seq_len: int, seed: int):
  """The "mqar" or "passkey" source whose rows are seq_len tokens long (ValueError naming the field)."""
  try:
    if f["source"] == "mqar":
      extra = 2 * f["mqar_pairs"] * (f["mqar_reads"] - 1)
      return recall.MQARSource(vocab_size=f["vocab_size"], length=seq_len - extra, num_pairs=f["mqar_pairs"],
                               num_records=f["num_records"], seed=seed, power_a=f["mqar_power"],
                               context_reads=f["mqar_reads"])
    depth = None if f["passkey_depth"] == -1 else float(f["passkey_depth"])
    return recall.PasskeySource(length=seq_len, num_records=f["num_records"], seed=seed, depth=depth,
                                digits=f["passkey_digits"])
  except ValueError as e:
    message = str(e)
    for argument, field in _RECALL_FIELDS[f["source"]].items():
      message = message.replace(f"`{argument}`", f"`{field}`")
    raise ValueError(f"data config ({f['source']} rows of seq_len = {seq_len}): {message}") from None


# The recall sources' arguments → the data config fields (or make_pipeline's arguments) they come from.
_RECALL_FIELDS = {
    "mqar": {"num_pairs": "mqar_pairs", "context_reads": "mqar_reads", "power_a": "mqar_power", "length": "seq_len",
             "num_records": "num_records", "vocab_size": "vocab_size"},
    "passkey": {"length": "seq_len", "digits": "passkey_digits", "depth": "passkey_depth",
                "num_records": "num_records"},
}


def _shuffle_seed(seed: int) -> int:
  """A 32-bit shuffle seed hashed from the run's seed: grain shuffles epoch e with seed + e, and nearby run seeds
  would otherwise replay one another's epochs."""
  return int(np.random.SeedSequence([seed, 0x5F1E]).generate_state(1)[0])


def _drawn(key: int, n: int, size: int) -> int:
  """The record at position n of a stream drawn with replacement: uniform in [0, size), independent for every n (a
  counter-based generator keyed by the run's seed, so any position is read without the ones before it)."""
  return int(np.random.Generator(np.random.Philox(key=key, counter=n)).integers(size))


def _finish_labelled(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Batched recall rows ("inputs", "labels" [B, T]) → the pipeline's batch."""
  labels = batch["labels"]
  scored = labels != recall.IGNORE
  return {"tokens": np.ascontiguousarray(batch["inputs"], np.int32),
          "targets": np.where(scored, labels, 0).astype(np.int32),
          "segment_ids": np.zeros(labels.shape, np.int32),
          "loss_mask": scored.astype(np.float32)}


def _finish(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Batched rows ("ids" [B, T + 1], "doc" [B, T + 1]: the document of each token) → the pipeline's batch."""
  ids, doc = batch["ids"], batch["doc"]
  loss_mask = (doc[:, :-1] == doc[:, 1:]).astype(np.float32)
  return {"tokens": np.ascontiguousarray(ids[:, :-1], np.int32),
          "targets": np.ascontiguousarray(ids[:, 1:], np.int32),
          "segment_ids": np.ascontiguousarray(doc[:, 1:] - doc[:, 1:2], np.int32),
          "loss_mask": loss_mask}


class TokenIdError(ValueError):
  """A token id outside [0, vocab_size) in a batch: `name` ("tokens" or "targets"), `row`, `position`, `value`;
  `detail` is the message without its prefix ("`targets`[1, 3] = 256 is outside the vocabulary [0, 256)")."""

  def __init__(self, name: str, row: int, position: int, value: int, vocab_size: int, where: str = "data"):
    self.name, self.row, self.position, self.value, self.vocab_size = name, row, position, value, vocab_size
    self.detail = f"`{name}`[{row}, {position}] = {value} is outside the vocabulary [0, {vocab_size})"
    super().__init__(f"{where}: {self.detail}")


def check_token_ids(batch: dict, vocab_size: int, where: str = "data") -> None:
  """TokenIdError ("{where}: `targets`[1, 3] = 256 is outside the vocabulary [0, 256)") for the first id outside
  [0, vocab_size) in a batch's tokens, then its targets ([B, T] each)."""
  for name in ("tokens", "targets"):
    ids = np.asarray(batch[name])
    bad = (ids < 0) | (ids >= vocab_size)
    if bad.any():
      row, position = map(int, np.argwhere(bad)[0])
      raise TokenIdError(name, row, position, int(ids[row, position]), vocab_size, where)


class Pipeline:
  """An endless iterator of batches (module docstring) with a JSON-serialisable, topology-free position.

  vocab_size: ids lie in [0, vocab_size) (every batch is checked: `check_token_ids`). tokenizer: the text's or the
  prepared tokens' (None for the other sources); eos_id: its EOS (None likewise). source: the record source (e.g.
  `recall.MQARSource`, for its examples' structure). rows: the rows of the global batch each batch holds, in order
  (None: the whole global batch), so that a bad token id is named by its global row.

  get_state() describes the next batch `__next__` returns, whatever a prefetch thread has read ahead:
  {"version", "signature", "batches": the global batches returned so far, "iterator": the global stream's grain
  state}. Neither the signature nor the position depends on the process: every process of a run holds the same
  state, and a state resumes the pipeline of any process of any number of processes. set_state(state) makes this
  pipeline return from there on exactly what the one that gave the state would have returned in its place. The
  state holds the pipeline's `signature` (source, sizes, the global batch, seed, vocabulary), and set_state raises
  ValueError for a state of a different pipeline (the prefetch depth and the processes may differ).
  """

  def __init__(self, dataset: grain.IterDataset, *, vocab_size: int, tokenizer, signature: dict[str, Any],
               source=None, rows=None):
    self.vocab_size = vocab_size
    self.source = source
    self.tokenizer = tokenizer
    self.eos_id = None if tokenizer is None else tokenizer.eos_id
    self.signature = signature
    self.rows = None if rows is None else tuple(int(r) for r in rows)
    self.batches = 0       # global batches returned so far
    # The iterator is closed and dropped by close() or at interpreter exit, while grain's modules still exist
    # (a prefetch iterator left to the final garbage collection fails to close).
    self._box = [iter(dataset)]
    self._release = weakref.finalize(self, _close, self._box)

  @property
  def _iterator(self) -> grain.DatasetIterator:
    if not self._box:
      raise ValueError("data: the pipeline is closed")
    return self._box[0]

  def __iter__(self) -> Pipeline:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = next(self._iterator)
    self.batches += 1
    try:
      check_token_ids(batch, self.vocab_size)
    except TokenIdError as e:
      if self.rows is None:
        raise
      raise TokenIdError(e.name, self.rows[e.row], e.position, e.value, e.vocab_size) from None
    return batch

  def get_state(self) -> dict[str, Any]:
    return {"version": STATE_VERSION, "signature": dict(self.signature), "batches": self.batches,
            "iterator": _to_json(self._iterator.get_state())}

  def set_state(self, state: dict[str, Any]) -> None:
    if state.get("version") != STATE_VERSION:
      raise ValueError(f"data: pipeline state version {state.get('version')!r}, expected {STATE_VERSION} (a "
                       "position saved by another version of the pipeline, whose batches were other ones)")
    theirs = state.get("signature", {})
    differ = sorted(k for k in set(theirs) | set(self.signature) if theirs.get(k) != self.signature.get(k))
    if differ:
      raise ValueError("data: the state belongs to a different pipeline: "
                       + ", ".join(f"{k} {theirs.get(k)!r} ≠ {self.signature.get(k)!r}" for k in differ))
    batches = state.get("batches")
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 0:
      raise ValueError(f"data: the state's `batches` must be an int ≥ 0, got {batches!r}")
    self._iterator.set_state(_from_json(state["iterator"]))
    self.batches = batches

  def close(self) -> None:
    """Stops the prefetch thread, if any; the pipeline returns no more batches."""
    self._release()


def _close(box: list) -> None:
  while box:
    box.pop().close()


def _rows(rows, batch_size: int, process_index: int, process_count: int) -> np.ndarray:
  """The rows of every global batch this process reads (module docstring); ValueError naming the argument."""
  if rows is None:
    if batch_size % process_count:
      raise ValueError(f"data: `batch_size` ({batch_size}, the global batch) must be a multiple of "
                       f"`process_count` ({process_count})")
    per = batch_size // process_count
    return np.arange(process_index * per, (process_index + 1) * per)
  if (process_index, process_count) != (0, 1):
    raise ValueError("data: give `rows` or `process_index` and `process_count`, not both")
  picked = list(rows)
  if (not picked or len(set(picked)) != len(picked)
      or not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) and 0 <= r < batch_size
                 for r in picked)):
    raise ValueError(f"data: `rows` must be distinct ints in [0, batch_size = {batch_size}), at least one; got "
                     f"{rows!r}")
  return np.array(picked, np.int64)


def _stack(records: list) -> Any:
  """Rows (arrays, or dicts of arrays) → one batch: each array stacked along a new leading axis."""
  if isinstance(records[0], collections.abc.Mapping):
    return {k: np.stack([r[k] for r in records]) for k in records[0]}
  return np.stack(records)


def make_pipeline(cfg, *, seq_len: int, batch_size: int, seed: int, process_index: int = 0,
                  process_count: int = 1, rows=None) -> Pipeline:
  """This process's rows of each global batch (module docstring). cfg: the data config; batch_size: the global
  batch's rows; seed: the shuffle's and the random sources' (an int in [0, 2³²)); process_index of
  process_count: this process reads rows [process_index·r, (process_index + 1)·r) of every global batch
  (r = batch_size / process_count); rows: instead, the rows it reads (distinct indices in [0, batch_size), in the
  order of its batch). ValueError naming the field for bad values."""
  f = _fields(cfg)
  seq_len = _int_field(seq_len, "seq_len", 1, "data")
  batch_size = _int_field(batch_size, "batch_size", 1, "data")
  seed = _int_field(seed, "seed", 0, "data")
  if seed >= 2**32:
    raise ValueError(f"data: `seed` must be below 2**32, got {seed}")
  process_count = _int_field(process_count, "process_count", 1, "data")
  process_index = _int_field(process_index, "process_index", 0, "data")
  if process_index >= process_count:
    raise ValueError(f"data: `process_index` ({process_index}) must be below `process_count` ({process_count})")
  mine = _rows(rows, batch_size, process_index, process_count)
  length = seq_len + 1
  tokenizer = None
  if f["source"] == "text":
    source = sources.TextSource(f["text_dir"], f["block_chars"], f["split"])
    # The tokenizer is trained on the whole corpus, whatever the split, so that both splits share it.
    tokenizer = tokenizers.make_tokenizer(f["tokenizer"], f["vocab_size"], source.texts_dir)
    vocab_size = tokenizer.vocab_size
  elif f["source"] == "tokens":
    source = tokens.TokenRows(f["path"], f["split"], length)
    tokenizer = source.tokenizer          # vocab_size and eos_id from metadata.json; loaded on first decode
    vocab_size = source.vocab_size
  elif f["source"] == "random":
    source = sources.RandomTokens(f["vocab_size"], length, f["num_records"], seed)
    vocab_size = f["vocab_size"]
  else:
    source = _recall_source(f, seq_len, seed)
    vocab_size = source.vocab_size

  # The global stream of records, endless and the same in every process: the source shuffled (a new order every
  # epoch), or records drawn with replacement.
  if f["order"] == "epoch":
    stream = grain.MapDataset.source(source).shuffle(seed=_shuffle_seed(seed)).repeat()
  else:
    key, size = _shuffle_seed(seed), len(source)
    stream = grain.MapDataset.range(2**62).map(lambda n: source[_drawn(key, n, size)])
  finish = _finish_labelled if f["source"] in ("mqar", "passkey") else _finish
  if f["source"] == "text":
    # Rows come out of the concatenated token stream: every process packs every global batch and keeps its rows.
    eos = np.array([tokenizer.eos_id], np.int32)
    docs = stream.map(lambda text: {"ids": np.concatenate([tokenizer.encode(text), eos])})
    packed = grain.experimental.ConcatThenSplitIterDataset(docs.to_iter_dataset(_READ),
                                                           length_struct={"ids": length})
    packed = packed.map(lambda row: {"ids": row["ids"], "doc": row["ids_segment_ids"]})
    whole = mine.size == batch_size and np.array_equal(mine, np.arange(batch_size))
    batches = packed.batch(batch_size, drop_remainder=True).map(
        lambda b: finish(b if whole else {k: v[mine] for k, v in b.items()}))
  else:
    # One record is one row: row j of global batch s is record s·batch_size + j of the stream, and this process
    # reads only its rows.
    if f["source"] == "random":
      as_row = lambda ids: {"ids": ids, "doc": np.zeros(length, np.int32)}
    else:
      as_row = lambda record: record      # "tokens": rows {"ids", "doc"}; recall: {"inputs", "labels"}
    offsets = mine.tolist()
    batches = grain.MapDataset.range(len(stream) // batch_size).map(
        lambda s: finish(_stack([as_row(stream[s * batch_size + j]) for j in offsets]))).to_iter_dataset(_READ)
  if f["prefetch"]:
    batches = grain.experimental.ThreadPrefetchIterDataset(batches, prefetch_buffer_size=f["prefetch"])

  signature = dict(source=f["source"], seq_len=seq_len, batch_size=batch_size, seed=seed, vocab_size=vocab_size,
                   records=len(source))
  if f["order"] != "epoch":
    signature.update(order=f["order"])
  if f["source"] == "text":
    signature.update(tokenizer=f["tokenizer"], block_chars=f["block_chars"], split=f["split"])
  elif f["source"] == "tokens":
    signature.update(split=f["split"], data=source.fingerprint)
  elif f["source"] == "mqar":
    signature.update(mqar_pairs=f["mqar_pairs"], mqar_power=f["mqar_power"], mqar_reads=f["mqar_reads"])
  elif f["source"] == "passkey":
    signature.update(passkey_depth=f["passkey_depth"], passkey_digits=f["passkey_digits"])
  return Pipeline(batches, vocab_size=vocab_size, tokenizer=tokenizer, signature=signature, source=source,
                  rows=mine)


# grain's iterator states hold tuples, and may hold bytes and numpy scalars, which JSON lacks: they travel tagged.
def _to_json(x):
  if isinstance(x, collections.abc.Mapping):
    if not all(isinstance(k, str) for k in x):
      raise TypeError(f"data: state keys must be strings, got {list(x)}")
    return {k: _to_json(v) for k, v in x.items()}
  if isinstance(x, tuple):
    return {"__tuple__": [_to_json(v) for v in x]}
  if isinstance(x, list):
    return [_to_json(v) for v in x]
  if isinstance(x, bytes):
    return {"__bytes__": base64.b64encode(x).decode("ascii")}
  if isinstance(x, np.generic):
    return x.item()
  if x is None or isinstance(x, (bool, int, float, str)):
    return x
  raise TypeError(f"data: cannot store {type(x).__name__} in a pipeline state")


def _from_json(x):
  if isinstance(x, dict):
    if set(x) == {"__tuple__"}:
      return tuple(_from_json(v) for v in x["__tuple__"])
    if set(x) == {"__bytes__"}:
      return base64.b64decode(x["__bytes__"])
    return {k: _from_json(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_from_json(v) for v in x]
  return x
