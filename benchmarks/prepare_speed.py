"""Tokenizing speed of `python -m osdn_jax.data.prepare`: MB of text per second, and per worker, per tokenizer.

    python -m benchmarks.prepare_speed --copies=1
    python -m benchmarks.prepare_speed --copies=4

The corpus: the Shakespeare texts (`make data`), each file cut into documents of --lines lines, written in file
order as one .jsonl into a temporary directory, --copies times over (the first copy meets each distinct word for the
first time; a further copy holds only words the segment cache has seen). Runs, each --repeat times (the fastest
kept: other work on the machine only slows a run): `bytes`; `bpe:--bpe` (its training pass included); and the BPE it
trained, given as a tokenizer.json (tokenizing alone); the last two with each --workers. Prints one markdown table:
tokenizer, workers, MB of text, seconds (the whole `prepare` call, tokenizer and worker start-up included), MB/s,
MB/s per worker, and MB per CPU second of this process, all its threads (with one worker, the whole work: a rate
that other work on the machine changes less than the seconds).
"""
from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
import time

from absl import app, flags

from osdn_jax.data import prepare, sources

_COPIES = flags.DEFINE_integer("copies", 4, "times the corpus is written into the .jsonl")
_LINES = flags.DEFINE_integer("lines", 60, "lines of a text file per document")
_BPE = flags.DEFINE_integer("bpe", 8000, "vocabulary of the trained BPE")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "--workers of the BPE runs")
_REPEAT = flags.DEFINE_integer("repeat", 2, "runs of each setting; the fastest is kept")


def write_corpus(path: pathlib.Path, copies: int, lines: int) -> int:
  """Writes the .jsonl; returns its documents' UTF-8 bytes."""
  documents = []
  for file in sources.corpus_files():
    text = sources.read_text(file).splitlines(keepends=True)
    documents += ["".join(text[i:i + lines]) for i in range(0, len(text), lines)]
  records = "".join(json.dumps({"text": d}) + "\n" for d in documents)
  path.write_text(records * copies, encoding="utf-8")
  return copies * sum(len(d.encode("utf-8")) for d in documents)


def _time(corpus: pathlib.Path, tokenizer: str, out: pathlib.Path, workers: int) -> tuple[float, float, int]:
  """(seconds, CPU seconds of this process (all its threads), MB of text) of the fastest of --repeat runs."""
  best = (float("inf"), 0.0)
  for _ in range(_REPEAT.value):
    start, cpu = time.perf_counter(), time.process_time()
    meta = prepare.prepare([str(corpus)], tokenizer, out, workers=workers, overwrite=True, progress=False,
                           verbose=False)
    best = min(best, (time.perf_counter() - start, time.process_time() - cpu))
  return *best, sum(s["text_bytes"] for s in meta["splits"].values())


def main(argv) -> None:
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    corpus = tmp / "corpus.jsonl"
    write_corpus(corpus, _COPIES.value, _LINES.value)
    rows = [("bytes", 1, *_time(corpus, "bytes", tmp / "out", 1))]
    spec = f"bpe:{_BPE.value}"
    for workers in map(int, _WORKERS.value):
      rows.append((spec, workers, *_time(corpus, spec, tmp / "out", workers)))
    shutil.copyfile(tmp / "out" / "tokenizer.json", tmp / "bpe.json")
    for workers in map(int, _WORKERS.value):
      rows.append(("tokenizer.json", workers, *_time(corpus, str(tmp / "bpe.json"), tmp / "out", workers)))
  print(f"corpus: Shakespeare × {_COPIES.value}, documents of {_LINES.value} lines; fastest of {_REPEAT.value} runs")
  print("| tokenizer | workers | MB of text | s | MB/s | MB/s per worker | MB per CPU s of the main process |")
  print("|---|---|---|---|---|---|---|")
  for name, workers, seconds, cpu, text in rows:
    mb = text / 1e6
    print(f"| {name} | {workers} | {mb:.1f} | {seconds:.1f} | {mb / seconds:.1f} | {mb / seconds / workers:.1f} | "
          f"{mb / cpu:.1f} |")


if __name__ == "__main__":
  app.run(main)
